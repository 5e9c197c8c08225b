"""The models bench.gpu_check builds for itself: random weights from jmoe.random_model, written as Hugging Face
safetensors checkpoints through jmoe's own name table, so they load with `jmoe.load` (and its offload engine)
on a machine with no PyTorch and no network: a lent GPU's image has transformers (for complete configs) and
safetensors, nothing more is needed. A small run writes configs without transformers (model_config)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from bench.helpers.common import smoke_spec

# One small case per family jmoe loads (shapes as tests/hf_models.py varies them: experts, top-k, GQA, shared
# experts, dense layers, MLA, grouped routers, sinks and biases).
FAMILY_CASES = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, rope_theta=1e6),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                      head_dim=16, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=4, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=4, clip_qkv=4.0),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32,
                        n_shared_experts=1, intermediate_size=64, first_k_dense_replace=1, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
                        num_nextn_predict_layers=1),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                     intermediate_size=64, first_k_dense_replace=1, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=8),
}
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512,
            initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None, rms_norm_eps=1e-6)
# Decode-speed models of a few GB in bf16 (full mode): Mixtral-shaped (8 experts, top-2, ~2.9 GB) and
# DeepSeek-shaped (V2-Lite's widths: 64 experts of 1408, top-6, MLA, shared experts; ~3.4 GB).
SPEED_MODELS = {
    "mixtral": dict(model_type="mixtral", hidden_size=2048, intermediate_size=7168, num_hidden_layers=4,
                    num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=32000, max_position_embeddings=4096, rope_theta=1e6),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=2048, intermediate_size=10944,
                        moe_intermediate_size=1408, num_hidden_layers=3, first_k_dense_replace=0,
                        n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1, n_shared_experts=2,
                        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=32000,
                        max_position_embeddings=4096, num_nextn_predict_layers=1),
}
STORAGE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def hf_config(model_type: str, **overrides) -> dict:
    """A complete config.json for `model_type` (transformers fills every key the overrides leave out)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**BASE, **overrides}).to_dict()


def model_config(model_type: str, small: bool, **overrides) -> dict:
    """hf_config's config.json, or when `small` only the keys given: jmoe reads the keys it leaves out as
    transformers fills them for the small runs' models (the cases name the keys where the defaults differ: rope_theta,
    num_nextn_predict_layers; tests/test_gpu_check.py compares the parsed configs), and a smoke run does not import
    transformers, with PyTorch 5 s of its CPU time."""
    return {**BASE, **overrides, "model_type": model_type} if small else hf_config(model_type, **overrides)


def speed_models(small: bool) -> dict[str, dict]:
    """SPEED_MODELS, at smoke size (bench.helpers.common.SMOKE_SIZES, the same experts and top-k) when `small`."""
    return {name: smoke_spec(spec) if small else spec for name, spec in SPEED_MODELS.items()}


SPEED_DTYPE = "bfloat16"  # what the decode-speed checkpoints store


def speed_config(name: str, small: bool) -> dict:
    """A decode-speed model's config.json (SPEED_MODELS' `name`, at smoke size when `small`), its dtype not set."""
    spec = dict(speed_models(small)[name])
    return model_config(spec.pop("model_type"), small, **spec)


def with_dtype(config: dict, dtype: str) -> dict:
    """config.json saying its parameters are `dtype`, as write_checkpoint stores them."""
    return {**config, "dtype": dtype, "torch_dtype": dtype}


def write_checkpoint(directory: Path, config: dict, dtype: str, seed: int = 0) -> Path:
    """A random-weight safetensors checkpoint of `config` (written once; reused when config.json is there)."""
    if (directory / "config.json").is_file():
        return directory
    from safetensors.numpy import save_file

    from jmoe.api import random_model
    from jmoe.checkpoint.hf_layout import expected_tensors
    from jmoe.config import parse_config
    from jmoe.model.params import flat_params
    from flax import nnx

    config = with_dtype(config, dtype)
    cfg = parse_config(config)
    params = flat_params(nnx.to_pure_dict(random_model(cfg, seed).params))
    tensors = {}
    for name, target in expected_tensors(cfg).items():
        data = np.asarray(params[target.param])[target.index]
        if target.deinterleave:  # the loader splits alternating (gate, up) columns: store them alternating
            half = data.shape[-1] // 2
            data = np.stack([data[..., :half], data[..., half:]], axis=-1).reshape(data.shape)
        data = data.T if target.transpose else data
        tensors[name] = np.ascontiguousarray(data.astype(STORAGE[dtype]))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory
