"""A fuzzer over what a checkpoint directory holds (config.json values, safetensors headers, index files):
jmoe.load either succeeds or raises a JmoeError naming the directory or file, quickly and without much memory.
Never another exception."""

import json
import os
import resource
import shutil
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jmoe

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3),
    max_leaves=6)
# CI runs a fixed set of 60 examples per test (derandomized: a red run is reproducible); JMOE_FUZZ_EXAMPLES=N
# explores N fresh random ones.
FUZZ = settings(max_examples=int(os.environ.get("JMOE_FUZZ_EXAMPLES", 60)), deadline=None,
                derandomize="JMOE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def load_fails_cleanly(directory):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        jmoe.load(directory, progress=False)
    except jmoe.JmoeError as e:
        assert str(directory) in str(e) or "config.json" in str(e), e
    assert time.perf_counter() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 300 * 1024  # KiB


@FUZZ
@given(data=st.data())
def test_config_values(small_mixtral_dir, tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("c") / "m"
    shutil.copytree(small_mixtral_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config)), label="key")
    config[key] = data.draw(JSON_VALUES, label="value")
    (directory / "config.json").write_text(json.dumps(config))
    load_fails_cleanly(directory)


@FUZZ
@given(data=st.data())
@pytest.mark.quick
def test_safetensors_headers(small_mixtral_dir, tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("h") / "m"
    shutil.copytree(small_mixtral_dir, directory)
    raw = (directory / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    name = data.draw(st.sampled_from(sorted(n for n in header if n != "__metadata__")), label="tensor")
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]), label="field")
    if field is None:
        header[name] = data.draw(JSON_VALUES, label="entry")
    else:
        header[name][field] = data.draw(JSON_VALUES | st.sampled_from(["I8", "BOOL", "F8_E4M3", "U64"]), label="value")
    body = json.dumps(header).encode()
    declared = data.draw(st.sampled_from([len(body), len(body) + 7, 2**63, 0]), label="declared length")
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", declared) + body + raw[8 + length:])
    load_fails_cleanly(directory)


@FUZZ
@given(weight_map=JSON_VALUES | st.dictionaries(st.text(max_size=40), st.text(max_size=30) | JSON_VALUES, max_size=4))
@pytest.mark.quick
def test_index_files(small_mixtral_dir, tmp_path_factory, weight_map):
    directory = tmp_path_factory.mktemp("i") / "m"
    shutil.copytree(small_mixtral_dir, directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    load_fails_cleanly(directory)
