"""Hostile and broken inputs at the loading boundary and in the converter (issue 16): each defect the issue
lists here gets a clear error, or now works."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import jmoe
from hf_models import edit_json, write_word_tokenizer
from jmoe.checkpoint.convert import OWNER_FILE, convert_checkpoint
from jmoe.checkpoint.orbax_store import TMP_INFIX
from jmoe.errors import CheckpointError, ConfigError

IDS = [[3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def good_dir(small_mixtral_dir, tmp_path_factory):
    """The small Mixtral checkpoint with a tokenizer (the converter copies and checks it)."""
    directory = tmp_path_factory.mktemp("hostile") / "m"
    shutil.copytree(small_mixtral_dir, directory)
    write_word_tokenizer(directory)
    return directory


@pytest.fixture
def copy_dir(good_dir, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(good_dir, directory)
    return directory


@pytest.mark.parametrize("key,value", [("num_local_experts", 1_000_000), ("num_local_experts", 10**9),
                                       ("num_hidden_layers", 100_000), ("num_hidden_layers", 10**9),
                                       ("vocab_size", 10**8), ("intermediate_size", 100_000)])
@pytest.mark.quick
def test_a_config_far_larger_than_its_weights_fails_fast(copy_dir, key, value):
    edit_json(copy_dir / "config.json", **{key: value})
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises((ConfigError, CheckpointError), match=rf"{key}|config.json describes at least"):
        jmoe.load(copy_dir, progress=False)
    assert time.perf_counter() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024  # KiB


@pytest.mark.parametrize("key,value,message", [
    ("num_attention_heads", 0, r"num_attention_heads must be a whole number in \[1, 4096\], found 0"),
    ("num_key_value_heads", 0, r"num_key_value_heads must be a whole number"),
    ("hidden_size", -8, r"hidden_size must be a whole number in \[1, 131072\], found -8"),
    ("hidden_size", "32", r"hidden_size must be a whole number .* found '32'"),
    ("num_local_experts", True, r"num_local_experts must be a whole number .* found True"),
    ("max_position_embeddings", 0, r"max_position_embeddings must be a whole number in \[1, "),
    ("eos_token_id", "2", r"eos_token_id must be a token id or a list of them, found '2'"),
    ("rms_norm_eps", float("nan"), r"rms_norm_eps must be a finite number > 0"),
])
def test_config_values_are_type_and_range_checked(copy_dir, key, value, message):
    edit_json(copy_dir / "config.json", **{key: value})
    with pytest.raises(ConfigError, match=message):
        jmoe.load(copy_dir, progress=False)


def test_a_config_that_is_a_json_list_is_refused(copy_dir):
    (copy_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json"):
        jmoe.load(copy_dir, progress=False)


@pytest.mark.parametrize("entry", ["../other/model.safetensors", "/etc/passwd", 7])
@pytest.mark.quick
def test_index_entries_never_leave_the_model_directory(copy_dir, entry):
    (copy_dir / "model.safetensors").rename(copy_dir / "shard.safetensors")
    names = json.loads(json.dumps({"weight_map": {"model.embed_tokens.weight": entry,
                                                  "lm_head.weight": "shard.safetensors"}}))
    (copy_dir / "model.safetensors.index.json").write_text(json.dumps(names))
    with pytest.raises(CheckpointError, match=r"weight_map entry .* is not a file name inside the model directory"):
        jmoe.load(copy_dir, progress=False)


def test_relative_paths_convert_and_load(good_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(good_dir, "hf")
    convert_checkpoint("hf", "out", progress=False)
    model = jmoe.load("out", progress=False)
    np.testing.assert_array_equal(np.asarray(model.logits(IDS)), np.asarray(jmoe.load("hf", progress=False).logits(IDS)))
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_converter_copies_only_checked_files(copy_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    (copy_dir / "tokenizer.json").unlink()
    (copy_dir / "tokenizer.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match="outside the model directory"):
        convert_checkpoint(copy_dir, tmp_path / "out", progress=False)
    (copy_dir / "tokenizer.json").unlink()
    (copy_dir / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(CheckpointError, match="not a tokenizer the `tokenizers` library can load"):
        convert_checkpoint(copy_dir, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "secret.txt"]  # nothing half-written


def test_hugging_face_cache_layout_converts(good_dir, tmp_path):
    """Files of a snapshot are links into the repository's blob store: allowed."""
    repository = tmp_path / "models--org--name"
    snapshot, blobs = repository / "snapshots" / "abc123", repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, source in enumerate(sorted(good_dir.iterdir())):
        shutil.copy(source, blobs / f"blob{i}")
        (snapshot / source.name).symlink_to(f"../../blobs/blob{i}")
    convert_checkpoint(snapshot, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_stale_temporaries_of_dead_conversions_are_removed(good_dir, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = __import__("socket").gethostname()
    stale, alive, foreign = (tmp_path / f".out{TMP_INFIX}{n}" for n in ("stale", "alive", "foreign"))
    for directory, owner in ((stale, {"pid": int(dead.stdout), "host": host}),
                             (alive, {"pid": os.getpid(), "host": host}), (foreign, None)):
        directory.mkdir()
        if owner:
            (directory / OWNER_FILE).write_text(json.dumps(owner))
    convert_checkpoint(good_dir, tmp_path / "out", progress=False)
    assert not stale.exists() and alive.exists() and foreign.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_conversion_removes_its_temporary_directory(good_dir, tmp_path, signum):
    # A background job starts with SIGINT ignored (as under CI); a terminal's Ctrl-C raises KeyboardInterrupt.
    script = ("import signal, sys, time, jmoe.checkpoint.convert as c\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "original = c._copy_checked_files\n"
              "def slow(*a):\n    print('writing', flush=True); time.sleep(60); return original(*a)\n"
              "c._copy_checked_files = slow\n"
              "c.convert_checkpoint(sys.argv[1], sys.argv[2], progress=False)\n")
    process = subprocess.Popen([sys.executable, "-c", script, str(good_dir), str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert process.stdout.readline().strip() == "writing"
    assert any(TMP_INFIX in p.name for p in tmp_path.iterdir())
    process.send_signal(signum)
    process.wait(timeout=60)
    assert process.returncode != 0
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def model(good_dir):
    return jmoe.load(good_dir, progress=False)


@pytest.mark.parametrize("call,message", [
    (lambda m: m.generate([[1, 2]], max_new_tokens=2.5), "max_new_tokens must be a whole number >= 1"),
    (lambda m: m.generate([[1, 2]], max_new_tokens=True), "max_new_tokens must be a whole number >= 1"),
    (lambda m: m.generate([[1.5, 2]], max_new_tokens=2), r"found an element \[1.5, 2\]"),
    (lambda m: m.generate([["a", "b"]], max_new_tokens=2), r"found an element \['a', 'b'\]"),
    (lambda m: m.generate(None, max_new_tokens=2), "found NoneType"),
    (lambda m: m.generate([[[1, 2]]], max_new_tokens=2), r"found an element \[\[1, 2\]\]"),
    (lambda m: m.generate([[1, 2]], max_new_tokens=2, seed=2**32 + 5), "seed must be below 2\\*\\*32"),
    (lambda m: m.generate([[1, 2]], max_new_tokens=2, seed=-1), "seed must be a whole number >= 0"),
    (lambda m: m.generate_text(b"w1 w2", max_new_tokens=2), "expected a str or a list of str, found bytes"),
    (lambda m: m.logits([[1.5, 2]]), r"found an element \[1.5, 2\]"),
])
@pytest.mark.quick
def test_api_arguments_are_checked(model, call, message):
    with pytest.raises(jmoe.InputError, match=message):
        call(model)


@pytest.mark.parametrize("dtype", ["int8", "bool"])
def test_integer_or_boolean_weights_are_refused(copy_dir, dtype):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy_dir / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(getattr(torch, dtype))
    save_file(tensors, copy_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype (I8|BOOL), expected a floating-point"):
        jmoe.load(copy_dir, progress=False)


def _poison(directory, name):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    tensors[name][0, 0] = float("nan")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.quick
def test_non_finite_weights_are_found_at_load_and_conversion_and_during_generation(copy_dir, tmp_path):
    _poison(copy_dir, "model.layers.1.self_attn.o_proj.weight")
    with pytest.raises(CheckpointError, match=r"parameter layers.1.attn.o.kernel holds 1 NaN or infinite values"):
        jmoe.load(copy_dir, progress=False)  # checked by default at this size
    with pytest.raises(CheckpointError, match="holds 1 NaN or infinite values"):
        convert_checkpoint(copy_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    model = jmoe.load(copy_dir, check_finite=False, progress=False)
    with pytest.raises(jmoe.NonFiniteError, match=r"generation step 0: decoder layer 1 \(of 2\) produced NaN"):
        model.generate([[1, 2, 3]], max_new_tokens=3)


@pytest.mark.quick
def test_a_flipped_byte_in_orbax_data_is_an_error(good_dir, tmp_path):
    out = convert_checkpoint(good_dir, tmp_path / "out", progress=False)
    data = max((p for p in (out / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match the checksum the converter recorded"):
        jmoe.load(out, progress=False)


def test_cli_refuses_a_huge_seed_before_printing_anything(good_dir, capsys):
    from jmoe.generate import main

    assert main(["--model", str(good_dir), "--prompt", "w1 w2", "--seed", str(2**40)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "seed must be below 2**32" in out.err
