"""jmoe parameters -> a Hugging Face qwen3_moe directory (config.json, generation_config.json, safetensors).

The tensor names and placements come from `jmoe.hf_layout.expected_tensors`, read backwards: each HF
tensor is `param[index]`, transposed where the table says so. That is exactly what jmoe's loader
reads, and the names are those transformers' Qwen3-MoE uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jmoe.config import ModelConfig, parse_config
from jmoe.checkpoint.hf_layout import expected_tensors
from jmoe.model.params import flat_params

STORAGE_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def qwen3_moe_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, num_experts: int, top_k: int, expert_width: int, max_positions: int,
                     rope_theta: float, eos_token_id: int, dtype: str) -> dict:
    """A complete qwen3_moe config.json: every MoE layer, tied embeddings, renormalised top-k."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_width,
        "intermediate_size": expert_width,  # unused: no dense layers (decoder_sparse_step 1, no mlp_only_layers)
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "dtype": dtype,
    }


def hf_tensors(params: nnx.State, cfg: ModelConfig, dtype) -> dict[str, np.ndarray]:
    flat = {path: np.asarray(v) for path, v in flat_params(nnx.to_pure_dict(params)).items()}
    out = {}
    for name, target in expected_tensors(cfg).items():
        data = flat[target.param][target.index]
        data = data.T if target.transpose else data
        if data.shape != target.hf_shape:
            raise AssertionError(f"{name}: built shape {data.shape}, layout table says {target.hf_shape}")
        out[name] = np.ascontiguousarray(data.astype(dtype))
    return out


# A ChatML template, so `python -m jmoe.serve` answers chat requests (the model was not trained on chats), with tools
# in Qwen's format (Hermes-style <tool_call> blocks, a one-line instruction), so it takes tool calls too.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8")


def export(params: nnx.State, hf_config: dict, tokenizer_json: Path, out_dir: Path) -> None:
    cfg = parse_config(hf_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(params, cfg, STORAGE_DTYPES[hf_config["dtype"]])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"],
                  "pad_token_id": hf_config["pad_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                        "model_max_length": hf_config["max_position_embeddings"]}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
