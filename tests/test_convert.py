"""HF safetensors -> Orbax conversion and restore: exact weights, placement, atomicity, clear errors."""

import hashlib
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmoe.checkpoint.convert as converter
from hf_models import FAMILY_CASES, BuiltOnFirstUse, write_checkpoint
from jmoe.config import load_config
from jmoe.convert import main
from jmoe.errors import CheckpointError
from jmoe.checkpoint.loading import load_model
from jmoe.model.params import flat_params
from jmoe.checkpoint.convert import convert_checkpoint
from jmoe.checkpoint.orbax_store import MANIFEST, MARKER, PARAMS_DIR, is_orbax_checkpoint, restore_model
from jmoe.memory import sharding_for


def params_of(module) -> dict:
    return flat_params(nnx.to_pure_dict(nnx.state(module, nnx.Param)))


def assert_same_params(restored, reference):
    got, want = params_of(restored), params_of(reference)
    assert got.keys() == want.keys()
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=str(path))


@pytest.fixture(scope="module")
def converted(hf_checkpoints, tmp_path_factory):
    """name -> Orbax directory converted from that family's HF checkpoint."""
    root = tmp_path_factory.mktemp("orbax")
    return BuiltOnFirstUse(lambda name: convert_checkpoint(hf_checkpoints[name][0], root / name, progress=False))


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_restore_equals_hf_loading(name, hf_checkpoints, converted):
    hf_dir = hf_checkpoints[name][0]
    cfg = load_config(hf_dir)
    assert is_orbax_checkpoint(converted[name]) and not is_orbax_checkpoint(hf_dir)
    assert_same_params(restore_model(converted[name], cfg, progress=False), load_model(hf_dir, cfg, progress=False))


@pytest.mark.quick
def test_restore_places_arrays_in_requested_memory_kind(hf_checkpoints, converted):
    name = "qwen2_moe_shared_dense"
    cfg = load_config(hf_checkpoints[name][0])
    offloaded = lambda path: sharding_for("pinned_host" if "experts" in path else "device")  # noqa: E731
    module = restore_model(converted[name], cfg, sharding_of=offloaded, progress=False)
    kinds = {path: leaf.sharding.memory_kind for path, leaf in params_of(module).items()}
    assert {p for p, k in kinds.items() if k == "pinned_host"} == {p for p in kinds if "experts" in p} != set()
    assert all(k == "device" for p, k in kinds.items() if "experts" not in p)
    assert_same_params(module, load_model(hf_checkpoints[name][0], cfg, progress=False))


def test_manifest_records_sources_and_copies_config(hf_checkpoints, converted):
    name = "mixtral_e4k2_gqa2"
    hf_dir, out = hf_checkpoints[name][0], converted[name]
    manifest = json.loads((out / MANIFEST).read_text())
    source = hf_dir / "model.safetensors"
    assert manifest["source"]["files"] == [{"name": "model.safetensors", "bytes": source.stat().st_size,
                                            "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}]
    assert manifest["dtype"] == "float32"
    assert manifest["params"]["layers.1.mlp.experts.w_gate_up"]["shape"] == [4, 32, 96]
    for copied in ("config.json", "generation_config.json"):
        assert (out / copied).read_bytes() == (hf_dir / copied).read_bytes()


@pytest.mark.quick
def test_sharded_checkpoint_and_cli_bfloat16(tmp_path):
    hf_dir = tmp_path / "hf"
    write_checkpoint(hf_dir, "olmoe", seed=7, max_shard_size="40KB", num_experts=4, num_experts_per_tok=2,
                     intermediate_size=24, num_attention_heads=4, num_key_value_heads=4)
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert len(shards) > 1
    assert main([str(hf_dir), str(tmp_path / "out"), "--dtype", "bfloat16", "--quiet"]) == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert sorted(f["name"] for f in manifest["source"]["files"]) == shards
    cfg = load_config(hf_dir)
    restored = restore_model(tmp_path / "out", cfg, progress=False)  # dtype defaults to the stored one
    assert {leaf.dtype for leaf in params_of(restored).values()} == {jnp.dtype("bfloat16")}
    assert_same_params(restored, load_model(hf_dir, cfg, dtype="bfloat16", progress=False))
    as_f32 = restore_model(tmp_path / "out", cfg, dtype="float32", progress=False)
    assert {leaf.dtype for leaf in params_of(as_f32).values()} == {jnp.dtype("float32")}


@pytest.mark.quick
def test_non_empty_output_needs_overwrite(hf_checkpoints, tmp_path, capsys):
    hf_dir = hf_checkpoints["mixtral_e4k2_gqa2"][0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main([str(hf_dir), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "precious" and not is_orbax_checkpoint(out)
    # --overwrite replaces a jmoe checkpoint or an empty directory, never other files.
    assert main([str(hf_dir), str(out), "--overwrite", "--quiet"]) == 2
    assert "is not a jmoe checkpoint" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    assert main([str(hf_dir), str(out), "--quiet"]) == 0  # empty: no --overwrite needed
    assert main([str(hf_dir), str(out), "--overwrite", "--quiet"]) == 0  # a jmoe checkpoint
    cfg = load_config(hf_dir)
    assert_same_params(restore_model(out, cfg, progress=False), load_model(hf_dir, cfg, progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directories left behind


def test_cli_reports_bad_source(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _fail_on_third_param(monkeypatch):
    real, calls = converter.stored_params, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated crash mid-conversion")
        return real(*args)

    monkeypatch.setattr(converter, "stored_params", flaky)


def test_interrupted_conversion_leaves_nothing_that_loads(hf_checkpoints, tmp_path, monkeypatch):
    hf_dir = hf_checkpoints["qwen3_moe_headdim_tied"][0]
    cfg = load_config(hf_dir)
    _fail_on_third_param(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(hf_dir, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither OUT_DIR nor the temporary directory
    with pytest.raises(CheckpointError, match="no such directory"):
        restore_model(tmp_path / "out", cfg, progress=False)


def test_interrupted_overwrite_keeps_previous_checkpoint(hf_checkpoints, converted, tmp_path, monkeypatch):
    name = "qwen3_moe_headdim_tied"
    hf_dir = hf_checkpoints[name][0]
    cfg = load_config(hf_dir)
    out = shutil.copytree(converted[name], tmp_path / "out")
    _fail_on_third_param(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_checkpoint(hf_dir, out, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert_same_params(restore_model(out, cfg, progress=False), load_model(hf_dir, cfg, progress=False))


def _damage_largest_data_file(out):
    data = max((p for p in (out / PARAMS_DIR).rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    data.unlink()


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / MANIFEST).unlink(), "no jmoe_manifest.json; the conversion did not finish"),
    (lambda out: (out / MARKER).unlink(), "no jmoe_orbax.json"),
    (lambda out: shutil.rmtree(out / PARAMS_DIR), "missing or not an Orbax checkpoint"),
    (lambda out: (out / MARKER).write_text('{"format": "jmoe-orbax", "format_version": 99}'), "version 99"),
    (lambda out: (out / MANIFEST).write_text('{"format": '), "manifest is not valid JSON"),
    (_damage_largest_data_file, "the checkpoint is damaged or incomplete"),
])
def test_damaged_checkpoint_is_a_clear_error(damage, message, hf_checkpoints, converted, tmp_path):
    name = "mixtral_e4k2_gqa2"
    out = shutil.copytree(converted[name], tmp_path / "out")
    damage(out)
    assert is_orbax_checkpoint(out)  # still recognised as Orbax, so jmoe.load reports this error
    with pytest.raises(CheckpointError, match=message):
        restore_model(out, load_config(hf_checkpoints[name][0]), progress=False)


def test_unfinished_conversion_directory_is_refused(hf_checkpoints, converted, tmp_path):
    name = "mixtral_e4k2_gqa2"
    leftover = shutil.copytree(converted[name], tmp_path / ".out.jmoe-converting-abc123")
    with pytest.raises(CheckpointError, match="unfinished conversion"):
        restore_model(leftover, load_config(hf_checkpoints[name][0]), progress=False)


def test_restore_with_wrong_config_names_the_mismatch(hf_checkpoints, converted):
    with pytest.raises(CheckpointError, match="does not match the config.*(missing|unexpected|shape)"):
        restore_model(converted["mixtral_e4k2_gqa2"], load_config(hf_checkpoints["olmoe_e8k4_clip"][0]),
                      progress=False)
