"""jmoe.checkpoint.expert_reader_orbax: the converter stores each routed expert in its own chunk with its own CRC-32;
an expert read from the Orbax checkpoint is bitwise restore_model's slice (float, int8, GPT-OSS with biases and
MXFP4, a cast dtype), reads only that expert's chunks, every file fault is a CheckpointError naming the file, the
parameter and the expert, and closing stops the threads; open_expert_reader picks the reader by format."""

import concurrent.futures
import errno
import gc
import json
import os
import re
import shutil
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from flax import nnx

import jmoe.checkpoint.convert as converter
import jmoe.checkpoint.expert_reader_orbax as orbax_reader
from hf_models import write_checkpoint
from jmoe.checkpoint.convert import convert_checkpoint
from jmoe.checkpoint.expert_reader import ExpertReader
from jmoe.checkpoint.expert_reader_orbax import THREAD_PREFIX, OrbaxExpertReader, open_expert_reader
from jmoe.checkpoint.orbax_store import MANIFEST, PARAMS_DIR, restore_model
from jmoe.checkpoint.read_buffers import PIECE_THREAD_PREFIX
from jmoe.config import load_config
from jmoe.errors import CheckpointError, InputError
from jmoe.model.params import flat_params

INDEX_BYTES = 20  # zarr3 sharding_indexed: one chunk's (offset, length) and the index's crc32c, after the chunk


# ---- checkpoints ----

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny Hugging Face checkpoints: a Mixtral (per-expert tensors) and a GPT-OSS (stacked, with biases)."""
    root = tmp_path_factory.mktemp("hf")
    write_checkpoint(root / "mixtral", "mixtral", seed=3, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)
    write_checkpoint(root / "gpt_oss", "gpt_oss", seed=5, intermediate_size=32, num_local_experts=4,
                     num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     sliding_window=4)
    return root


CONVERSIONS = {"mixtral": ("mixtral", None, None), "mixtral_int8": ("mixtral", "int8", None),
               "mixtral_bfloat16": ("mixtral", None, "bfloat16"), "gpt_oss": ("gpt_oss", None, None),
               "gpt_oss_mxfp4": ("gpt_oss", "mxfp4", None)}  # name -> (source, expert_dtype, dtype)


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    return {name: convert_checkpoint(hf_dirs / source, root / name, expert_dtype=fmt, dtype=dtype, progress=False)
            for name, (source, fmt, dtype) in CONVERSIONS.items()}


@pytest.fixture
def mixtral_copy(converted, tmp_path):
    """A fresh copy of the float Mixtral conversion that a test may damage (copytree keeps the mtimes)."""
    return shutil.copytree(converted["mixtral"], tmp_path / "m")


def restored_experts(directory: Path, dtype=None) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {name: stacked array}} of every routed experts parameter restore_model holds."""
    module = restore_model(directory, load_config(directory), dtype=dtype, progress=False)
    out: dict[int, dict[str, np.ndarray]] = {}
    for path, leaf in flat_params(nnx.to_pure_dict(nnx.state(module, nnx.Param))).items():
        if path[0] == "layers" and path[-2] == "experts":
            out.setdefault(path[1], {})[path[-1]] = np.asarray(leaf)
    return out


def assert_bitwise_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (what, got.dtype, got.shape, expected.shape)
    assert got.tobytes() == expected.tobytes(), f"{what}: differs from restore_model's"


def reader(directory: Path, **kwargs) -> OrbaxExpertReader:
    return OrbaxExpertReader(directory, load_config(directory), **kwargs)


def quoted(text) -> str:
    return re.escape(str(text))


def state_dir(directory: Path) -> Path:
    return directory / PARAMS_DIR / "state"  # where Orbax's partial save put the parameter tree


def stored_array(directory: Path, key: str) -> ts.TensorStore:
    """An array of the checkpoint opened here, the way Orbax's own restore opens it (zarr3 over OCDBT)."""
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir(directory)}/",
                                                   "path": key}}).result()


def ocdbt_values(directory: Path) -> dict[str, tuple]:
    """OCDBT key -> ("file", path, offset, length) or ("inline", bytes), from the tiny checkpoint's one B+tree
    node (parsed here, apart from the reader's own walk)."""
    base = ts.KvStore.open(f"file://{state_dir(directory)}/").result()
    manifest = ts.ocdbt.dump(base).result()
    latest = max(manifest["versions"], key=lambda v: v["generation_number"])
    assert latest["root_height"] == 0, "a tiny checkpoint's B+tree is one leaf node"
    values = {}
    for entry in ts.ocdbt.dump(base, latest["root"]["location"]).result()["entries"]:
        if "indirect_value" in entry:  # value:<base path>:<relative path>:<offset>:<length>
            head, offset, length = entry["indirect_value"][len("value:"):].rsplit(":", 2)
            prefix, relative = head.split(":", 1)
            values[entry["key"].decode()] = ("file", state_dir(directory) / prefix / relative, int(offset), int(length))
        else:
            values[entry["key"].decode()] = ("inline", entry["inline_value"])
    return values


def expert_chunk(directory: Path, key: str, expert: int) -> tuple[Path, int, int]:
    """(data file, offset, length) of the one chunk of expert `expert` of parameter `key`."""
    chunks = [v for k, v in ocdbt_values(directory).items() if k.startswith(f"{key}/c/{expert}/")]
    assert len(chunks) == 1 and chunks[0][0] == "file", chunks
    return chunks[0][1:]


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith((THREAD_PREFIX, PIECE_THREAD_PREFIX))]


def open_files() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            pass
    return sorted(targets)


# ---- exactness ----

@pytest.mark.parametrize("name", list(CONVERSIONS))
@pytest.mark.quick
def test_every_expert_is_what_restore_model_holds(name, converted):
    directory = converted[name]
    cfg = load_config(directory)
    expected = restored_experts(directory)
    with reader(directory) as experts:
        assert experts.layers == tuple(i for i, moe in enumerate(cfg.moe_layers) if moe) == tuple(sorted(expected))
        assert experts.num_experts == cfg.num_experts
        futures = {(layer, e): experts.submit(layer, e) for layer in experts.layers for e in range(cfg.num_experts)}
        for (layer, e), future in futures.items():
            got = future.result()
            assert sorted(got) == sorted(expected[layer]), (layer, e)
            for param, value in got.items():
                assert_bitwise_equal(value, expected[layer][param][e], f"{name} layer {layer} expert {e} {param}")
    stored = expected[min(expected)]
    if name.endswith(("int8", "mxfp4")):
        assert {"w_gate_up_scale", "w_down_scale"} <= set(stored)
    if name.startswith("gpt_oss"):
        assert {"b_gate_up", "b_down"} <= set(stored)
    if name.endswith("bfloat16"):
        assert stored["w_down"].dtype == np.dtype("bfloat16")


def test_a_cast_dtype_reads_as_restore_model_casts(converted):
    directory = converted["gpt_oss"]
    expected = restored_experts(directory, dtype="bfloat16")
    with reader(directory, dtype="bfloat16") as experts:
        for layer in experts.layers:
            for e in range(experts.num_experts):
                for param, value in experts.read(layer, e).items():
                    assert value.dtype == np.dtype("bfloat16")
                    assert_bitwise_equal(value, expected[layer][param][e], f"bfloat16 {layer} {e} {param}")


# ---- layout: one expert per chunk, one CRC-32 per expert ----

@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_the_converter_stores_each_expert_in_its_own_chunk_with_its_crc(name, converted):
    directory = converted[name]
    manifest = json.loads((directory / MANIFEST).read_text())
    expected = restored_experts(directory)
    keys = set(ocdbt_values(directory))
    for layer, params in expected.items():
        for param, stacked in params.items():
            key = f"layers.{layer}.mlp.experts.{param}"
            array = stored_array(directory, key)
            assert tuple(array.chunk_layout.read_chunk.shape) == (1,) + stacked.shape[1:], key
            chunk_keys = {k for k in keys if k.startswith(key + "/c/")}
            zeros = "/0" * (stacked.ndim - 1)
            assert chunk_keys == {f"{key}/c/{e}{zeros}" for e in range(stacked.shape[0])}, key
            entry = manifest["params"][key]
            assert entry["expert_crc32"] == [zlib.crc32(stacked[e].tobytes()) for e in range(stacked.shape[0])]
            assert entry["crc32"] == zlib.crc32(stacked.tobytes())  # the whole-parameter CRC-32 as before
    other = stored_array(directory, "embed")  # everything else stays one chunk
    assert tuple(other.chunk_layout.read_chunk.shape) == tuple(other.shape)
    assert not any("expert_crc32" in entry for k, entry in manifest["params"].items() if ".experts." not in k)


def rchar() -> int:
    """Bytes this process has read through read/pread calls (TensorStore's file reads included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.quick
def test_a_read_reads_only_that_experts_chunks(converted):
    directory = converted["mixtral"]  # float32: every expert chunk over 1 KiB, so none is inline in a node
    expected = restored_experts(directory)
    values = ocdbt_values(directory)
    data_bytes = sum(p.stat().st_size for p in state_dir(directory).rglob("*") if p.is_file())
    with reader(directory) as experts:
        experts.read(0, 0)  # the OCDBT manifest and B+tree node, read once and kept
        for layer in experts.layers:
            for e in range(experts.num_experts):
                chunks = [v for k, v in values.items()
                          if k.startswith(f"layers.{layer}.mlp.experts.") and f"/c/{e}/" in k]
                assert len(chunks) == 2 and all(kind == "file" for kind, *_ in chunks)
                wanted = sum(length for *_, length in chunks)
                assert wanted == sum(a[e].nbytes + INDEX_BYTES for a in expected[layer].values())
                assert experts.checkpoint_bytes(layer, e) == wanted
                start = rchar()
                overhead = rchar() - start  # reading /proc/self/io counts too
                start = rchar()
                experts.read(layer, e)
                read = rchar() - start - overhead
                assert abs(read - wanted) <= 8, (layer, e, read, wanted)  # digits of the counter may change
                assert wanted * experts.num_experts * len(experts.layers) < data_bytes


def test_the_btree_walk_finds_every_chunk_of_a_deep_tree(tmp_path):
    """A large checkpoint's B+tree has interior nodes whose children's keys continue a common prefix: the walk
    must rebuild each key and find each value's file and bytes (here nodes of at most 300 bytes: height > 1)."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/",
                             "config": {"max_inline_value_bytes": 16, "max_decoded_node_bytes": 300}}).result()
    written = {}
    with ts.Transaction() as txn:
        for layer in range(3):
            for e in range(40):
                for name, size in (("w_gate_up", 40 + e), ("b_down", 8)):  # indirect and inline values
                    key = f"layers.{layer}.mlp.experts.{name}/c/{e}/0"
                    written[key] = bytes([layer, e]) * (size // 2)
                    store.with_transaction(txn)[key] = written[key]
        store.with_transaction(txn)["layers.0.mlp.router.kernel/c/0/0"] = b"r" * 64  # not asked for
    manifest = ts.ocdbt.dump(store.base).result()
    assert max(v["root_height"] for v in manifest["versions"]) > 1
    wanted = {f"layers.{layer}.mlp.experts.{name}" for layer in range(3) for name in ("w_gate_up", "b_down")}
    found = orbax_reader._ocdbt_chunks(tmp_path, wanted)
    got = {}
    for name, chunks in found.items():
        for grid, chunk in chunks:
            key = chunk.key.decode()
            assert key == f"{name}/c/{grid[0]}/{grid[1]}" and key not in got
            assert chunk.nodes and all(node.is_file() for node in chunk.nodes)
            if chunk.value.file is None:
                got[key] = ("inline", chunk.value.length)
            else:
                with open(chunk.value.file, "rb") as f:
                    f.seek(chunk.value.offset)
                    got[key] = f.read(chunk.value.length)
    assert got == {k: v if len(v) > 16 else ("inline", len(v)) for k, v in written.items()}


# ---- faults ----

def flip_bytes(path: Path, offset: int, length: int) -> bytes:
    """Change `length` bytes at `offset` keeping the file's size and mtime; returns the original bytes."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        original = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0x40 for b in original))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return original


def test_a_damaged_chunk_fails_its_crc_naming_file_parameter_and_expert(mixtral_copy):
    key = "layers.1.mlp.experts.w_down"
    path, offset, length = expert_chunk(mixtral_copy, key, 2)
    with reader(mixtral_copy) as experts:
        first = experts.read(1, 2)  # the first read is checked too: damaged before it, it fails the same way
        original = flip_bytes(path, offset, length - INDEX_BYTES)  # the values, not zarr's own index
        for _ in range(2):
            with pytest.raises(CheckpointError, match=rf"{quoted(path)}: parameter {quoted(key)} expert 2 .*"
                                                      r"CRC-32 .* the converter recorded"):
                experts.read(1, 2)
        experts.read(1, 1)  # other experts of the same parameter and file are unaffected
        experts.read(0, 2)
        flip_bytes(path, offset, length - INDEX_BYTES)  # back to the original bytes: read as before
        for param, value in experts.read(1, 2).items():
            assert_bitwise_equal(value, first[param], param)
    assert len(original) == length - INDEX_BYTES
    flip_bytes(path, offset, length - INDEX_BYTES)
    with reader(mixtral_copy) as experts:  # damaged before the reader opened it: its first read fails
        with pytest.raises(CheckpointError, match=rf"parameter {quoted(key)} expert 2 .*CRC-32"):
            experts.read(1, 2)


def test_a_file_changed_or_truncated_after_construction_is_an_error(mixtral_copy):
    key = "layers.0.mlp.experts.w_gate_up"
    path, offset, _ = expert_chunk(mixtral_copy, key, 3)
    with reader(mixtral_copy) as experts:
        experts.read(0, 3)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(CheckpointError, match=rf"{quoted(path)}: the checkpoint file changed while the model "
                                                  rf"runs: .* before reading layer 0 expert 3 .*{quoted(key)}"
                                                  r".*restore it and load the model again"):
            experts.read(0, 3)
    with reader(mixtral_copy) as experts:
        experts.read(0, 3)
        os.truncate(path, offset + 10)
        with pytest.raises(CheckpointError, match=rf"{quoted(path)}: the checkpoint file changed .*expert 3"):
            experts.read(0, 3)


def test_a_file_truncated_before_construction_is_refused(mixtral_copy):
    key = "layers.1.mlp.experts.w_gate_up"
    path, offset, _ = expert_chunk(mixtral_copy, key, 1)
    os.truncate(path, offset + 10)
    with pytest.raises(CheckpointError, match=rf"{quoted(path)}: parameter layers\.\d\.mlp\.experts\.w_\w+ "
                                              r"expert \d .*the file is truncated"):
        reader(mixtral_copy)


class FlakyReads:
    """orbax_reader._read_value replaced: fails the calls `fail` picks with the error a failing drive gives."""

    def __init__(self, monkeypatch, fail):
        self.calls, self.fail, self.real = 0, fail, orbax_reader._read_value
        self.lock = threading.Lock()
        monkeypatch.setattr(orbax_reader, "_read_value", self)

    def __call__(self, *args):
        with self.lock:
            self.calls += 1
            call = self.calls
        if self.fail(call):
            raise OSError(errno.EIO, "Input/output error")
        return self.real(*args)


def test_a_failed_read_is_retried_then_reported_with_the_attempts(mixtral_copy, monkeypatch):
    with reader(mixtral_copy, retries=2) as experts:
        expected = experts.read(1, 0)
        once = FlakyReads(monkeypatch, fail=lambda call: call == 1)
        for param, value in experts.read(1, 0).items():
            assert_bitwise_equal(value, expected[param], param)
        assert once.calls == len(expected) + 1  # one failed attempt, then each parameter's read
        always = FlakyReads(monkeypatch, fail=lambda call: True)
        with pytest.raises(CheckpointError, match=rf"{quoted(state_dir(mixtral_copy))}: reading parameter "
                                                  r"layers\.1\.mlp\.experts\.w_\w+ expert 0 .* failed 3 times \(3 "
                                                  r"attempts: 1 \+ retries=2\); last error: \[Errno 5\] "
                                                  r"Input/output error"):
            experts.read(1, 0)
        assert always.calls == 3
    with reader(mixtral_copy, retries=0) as experts:
        never = FlakyReads(monkeypatch, fail=lambda call: True)
        with pytest.raises(CheckpointError, match=r"failed 1 times \(1 attempts"):
            experts.read(0, 0)
        assert never.calls == 1


def test_a_checkpoint_without_per_expert_chunks_or_crcs_is_refused(hf_dirs, mixtral_copy, tmp_path, monkeypatch):
    manifest = json.loads((mixtral_copy / MANIFEST).read_text())
    for entry in manifest["params"].values():
        entry.pop("expert_crc32", None)
    (mixtral_copy / MANIFEST).write_text(json.dumps(manifest))
    restore_model(mixtral_copy, load_config(mixtral_copy), progress=False)  # an older manifest still restores
    with pytest.raises(CheckpointError, match="no per-expert CRC-32s for layers.0.mlp.experts.w_down .*convert "
                                              "the checkpoint again"):
        reader(mixtral_copy)
    monkeypatch.setattr(converter, "_one_chunk_per_expert", lambda keypath, value: None)  # the former layout
    whole = convert_checkpoint(hf_dirs / "mixtral", tmp_path / "whole", progress=False)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.w_\w+ is not stored one expert per chunk "
                                              r"\(chunks of \[4, "):
        reader(whole)


def test_a_checkpoint_with_compressed_chunks_is_refused(hf_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(converter, "COMPRESS", True)
    compressed = convert_checkpoint(hf_dirs / "mixtral", tmp_path / "zstd", progress=False)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.w_\w+ is stored with the zarr3 codecs .*"
                                              r"zstd.*the expert reader reads the converter's: .*convert the "
                                              r"checkpoint again"):
        reader(compressed)


def test_a_damaged_shard_index_is_an_error_naming_file_parameter_and_expert(mixtral_copy):
    key = "layers.1.mlp.experts.w_down"
    path, offset, length = expert_chunk(mixtral_copy, key, 2)
    with reader(mixtral_copy) as experts:
        flip_bytes(path, offset + length - INDEX_BYTES, 8)  # the index's offset of the values
        with pytest.raises(CheckpointError, match=rf"{quoted(path)}: parameter {quoted(key)} expert 2 .*shard "
                                                  r"index naming bytes .* the data file is damaged"):
            experts.read(1, 2)


@pytest.mark.quick
def test_bad_arguments_are_clear_errors(converted):
    with reader(converted["mixtral"]) as experts:
        with pytest.raises(InputError, match=r"layer 2 expert 0 is not a routed expert .*MoE layers are \[0, 1\], "
                                             r"experts 0..3"):
            experts.read(2, 0)
        with pytest.raises(InputError, match="layer 0 expert 4 is not a routed expert"):
            experts.submit(0, 4)
        with pytest.raises(InputError, match="layer True expert 0"):
            experts.read(True, 0)
    for kwargs, match in (({"threads": 0}, "threads must be a whole number >= 1"),
                          ({"retries": -1}, "retries must be a whole number >= 0")):
        with pytest.raises(InputError, match=match):
            reader(converted["mixtral"], **kwargs)


# ---- lifecycle and the factory ----

def test_close_stops_the_threads_and_releases_the_arrays(converted):
    before = open_files()
    experts = reader(converted["mixtral"], threads=3)
    futures = [experts.submit(layer, e) for layer in experts.layers for e in range(4) for _ in range(3)]
    concurrent.futures.wait(futures)
    assert len(reader_threads()) == 3 + 3 // 2 + 3  # reads (half again kept for demand reads), their pieces
    queued = [experts.submit(layer, e) for _ in range(10) for layer in experts.layers for e in range(4)]
    experts.close()
    for future in queued:
        assert future.done() and (future.cancelled() or "w_down" in future.result())
    assert not reader_threads() and open_files() == before
    experts.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed; experts cannot be read after close"):
        experts.read(0, 0)


def test_a_reader_nobody_closed_stops_its_threads_when_collected(converted):
    experts = reader(converted["mixtral"], threads=2)
    experts.read(0, 1)
    threads = reader_threads()
    assert threads
    del experts
    gc.collect()
    for thread in threads:  # the pool's threads end once the pool is collected
        thread.join(timeout=10)
    assert not reader_threads()


def test_the_factory_picks_the_reader_by_format(hf_dirs, converted):
    hf_dir, orbax_dir = hf_dirs / "mixtral", converted["mixtral"]
    with open_expert_reader(hf_dir, load_config(hf_dir), threads=2) as from_hf, \
            open_expert_reader(orbax_dir, load_config(orbax_dir), retries=1) as from_orbax:
        assert type(from_hf) is ExpertReader and type(from_orbax) is OrbaxExpertReader
        for layer in from_hf.layers:  # float32 both ways: the same numbers
            for e in range(from_hf.num_experts):
                hf_expert, orbax_expert = from_hf.read(layer, e), from_orbax.read(layer, e)
                assert sorted(hf_expert) == sorted(orbax_expert)
                for param in hf_expert:
                    assert_bitwise_equal(orbax_expert[param], hf_expert[param], f"{layer} {e} {param}")
