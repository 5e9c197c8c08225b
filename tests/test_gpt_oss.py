"""GPT-OSS specifics beyond the parity cases in hf_models.FAMILY_CASES: MXFP4 checkpoints (an independent
encoder writes them; transformers dequantizes them on CPU), kept MXFP4 end to end, and config errors."""

import json

import numpy as np
import pytest

import jmoe
from hf_models import VOCAB, write_checkpoint

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An OCP MX encoder unlike jmoe's: the smallest power-of-two scale that fits the group's maximum in 6,
    nearest code by search. w [E, K, N] -> blocks [E, N, K/32, 16] (value 2i low nibble), scales [E, N, K/32]."""
    experts, k, n = w.shape
    groups = w.transpose(0, 2, 1).reshape(experts, n, k // 32, 32).astype(np.float64)
    amax = np.abs(groups).max(-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6)), -127).astype(np.int64)
    codes = np.abs((groups / np.exp2(exponent)[..., None])[..., None] - E2M1).argmin(-1).astype(np.uint8)
    blocks, scales = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exponent + 127).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)  # safetensors saves strided arrays wrongly


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The format's definition, back to [E, K, N]."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
    values = E2M1[codes] * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*scales.shape[:2], -1).transpose(0, 2, 1)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A float GPT-OSS checkpoint written by transformers, its stacked expert weights re-encoded as MXFP4
    blocks and scales the way GPT-OSS ships them. Returns (directory, {expert tensor name: dequantized})."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path_factory.mktemp("gpt_oss") / "mxfp4"
    write_checkpoint(directory, "gpt_oss", seed=4, hidden_size=64, intermediate_size=32, num_local_experts=4,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     sliding_window=4)
    tensors, stored, reference = load_file(directory / "model.safetensors"), {}, {}
    for name, value in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"] = encode_mxfp4(value)
            reference[name] = decode_mxfp4(stored[name + "_blocks"], stored[name + "_scales"])
        else:
            stored[name] = value
    save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, reference


IDS = np.random.RandomState(0).randint(0, VOCAB, (2, 10))


@pytest.mark.quick
def test_mxfp4_checkpoint_dequantizes_as_defined_and_as_transformers_does(mxfp4_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    directory, reference = mxfp4_checkpoint
    model = jmoe.load(directory, expert_dtype="float32", progress=False)
    experts = model.module().moe_blocks()[0].experts
    gate_up = reference["model.layers.0.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(np.asarray(experts.w_gate_up[...]),
                                  np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], -1).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(experts.w_down[...]),
                                  reference["model.layers.0.mlp.experts.down_proj"].astype(np.float32))
    hf = AutoModelForCausalLM.from_pretrained(directory, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.logits(IDS)), expected, rtol=0, atol=1e-4)


def test_mxfp4_experts_stay_mxfp4_end_to_end_with_the_same_values(mxfp4_checkpoint):
    directory, _ = mxfp4_checkpoint
    full = jmoe.load(directory, expert_dtype="float32", progress=False)
    packed = jmoe.load(directory, cache=1, progress=False)  # expert_dtype None: the checkpoint's format
    weights = packed.module().moe_blocks()[0].experts.weights()
    assert weights.w_gate_up.fmt == "mxfp4"
    np.testing.assert_array_equal(np.asarray(weights.w_gate_up.dequantize(np.float32)),
                                  np.asarray(full.module().moe_blocks()[0].experts.w_gate_up[...]))
    np.testing.assert_allclose(np.asarray(packed.logits(IDS)), np.asarray(full.logits(IDS)), rtol=0, atol=1e-5)
    plan = jmoe.plan(directory, compile=False)
    assert plan.headers.stored_dtypes.get("MXFP4") == 2 * plan.config.num_moe_layers


def test_gpt_oss_config_and_checkpoint_errors(mxfp4_checkpoint, tmp_path):
    import shutil

    directory, _ = mxfp4_checkpoint
    broken = tmp_path / "no_quant"
    shutil.copytree(directory, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(jmoe.CheckpointError, match="MXFP4 blocks but config.json has no quantization_config"):
        jmoe.load(broken, progress=False)
    config.update(quantization_config={"quant_method": "bitsandbytes"})
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(jmoe.ConfigError, match="unsupported quantization_config.quant_method 'bitsandbytes'"):
        jmoe.load(broken, progress=False)
    config.update(quantization_config=None, swiglu_limit=-1)
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(jmoe.ConfigError, match="swiglu_limit must be a finite number > 0"):
        jmoe.load(broken, progress=False)
