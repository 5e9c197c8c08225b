"""The table that maps Hugging Face tensor names onto jmoe parameters.

Each row is a name template -> (jmoe parameter path, where in that parameter it goes, whether it is
transposed). Expanding the table for a config gives every tensor the checkpoint must contain with its
expected shape, so loading and conversion can check each tensor by name and shape and report what is
missing or unexpected.
"""

from __future__ import annotations

import dataclasses

from jmoe.model.params import ParamPath
from jmoe.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorTarget:
    """Where one HF tensor lands: param[index] = tensor.T if transpose else tensor."""

    param: ParamPath
    index: tuple  # ints and slices into the jmoe parameter; () = the whole parameter
    transpose: bool
    hf_shape: tuple[int, ...]


# Per family: the MoE block's module name and the expert projection names for (gate, up, down).
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}

# Names a checkpoint may carry that jmoe deliberately does not load, with the reason.
IGNORABLE = {
    "lm_head.weight": "tie_word_embeddings is true: the output head is the input embedding",
}


def _swiglu_targets(prefix: str, names: tuple[str, str, str], param: ParamPath, lead: tuple,
                    d: int, f: int) -> dict[str, TensorTarget]:
    """gate/up/down projections ([f, d], [f, d], [d, f] in HF) into fused w_gate_up [.., d, 2f] and w_down."""
    gate, up, down = names
    full = slice(None)
    return {
        f"{prefix}.{gate}.weight": TensorTarget(param + ("w_gate_up",), lead + (full, slice(0, f)), True, (f, d)),
        f"{prefix}.{up}.weight": TensorTarget(param + ("w_gate_up",), lead + (full, slice(f, 2 * f)), True, (f, d)),
        f"{prefix}.{down}.weight": TensorTarget(param + ("w_down",), lead, True, (d, f)),
    }


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorTarget]:
    """Every tensor name a checkpoint of this config must contain, with its target and HF shape."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    moe_name, expert_names = _MOE_NAMES[cfg.family]
    table: dict[str, TensorTarget] = {
        "model.embed_tokens.weight": TensorTarget(("embed",), (), False, (cfg.vocab_size, d)),
        "model.norm.weight": TensorTarget(("final_norm", "scale"), (), False, (d,)),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = TensorTarget(("lm_head",), (), True, (cfg.vocab_size, d))
    for i in range(cfg.num_layers):
        pre, layer = f"model.layers.{i}", ("layers", i)
        table[f"{pre}.input_layernorm.weight"] = TensorTarget(layer + ("input_norm", "scale"), (), False, (d,))
        table[f"{pre}.post_attention_layernorm.weight"] = TensorTarget(layer + ("post_norm", "scale"), (), False, (d,))
        for proj, (n_in, n_out) in {"q": (d, q_out), "k": (d, kv_out), "v": (d, kv_out), "o": (q_out, d)}.items():
            attn = layer + ("attn", proj)
            table[f"{pre}.self_attn.{proj}_proj.weight"] = TensorTarget(attn + ("kernel",), (), True, (n_out, n_in))
            if (cfg.qkv_bias and proj != "o") or (cfg.o_bias and proj == "o"):
                table[f"{pre}.self_attn.{proj}_proj.bias"] = TensorTarget(attn + ("bias",), (), False, (n_out,))
        if cfg.qk_norm != "none":
            q_dim, k_dim = (hd, hd) if cfg.qk_norm == "per_head" else (q_out, kv_out)
            table[f"{pre}.self_attn.q_norm.weight"] = TensorTarget(layer + ("attn", "q_norm", "scale"), (), False, (q_dim,))
            table[f"{pre}.self_attn.k_norm.weight"] = TensorTarget(layer + ("attn", "k_norm", "scale"), (), False, (k_dim,))
        mlp = layer + ("mlp",)
        if not cfg.moe_layers[i]:
            table.update(_swiglu_targets(f"{pre}.mlp", ("gate_proj", "up_proj", "down_proj"), mlp, (),
                                         d, cfg.dense_intermediate_size))
            continue
        moe = f"{pre}.{moe_name}"
        table[f"{moe}.gate.weight"] = TensorTarget(mlp + ("router", "kernel"), (), True, (cfg.num_experts, d))
        for e in range(cfg.num_experts):
            table.update(_swiglu_targets(f"{moe}.experts.{e}", expert_names, mlp + ("experts",), (e,),
                                         d, cfg.expert_intermediate_size))
        if cfg.shared_expert_intermediate_size:
            table.update(_swiglu_targets(f"{moe}.shared_expert", ("gate_proj", "up_proj", "down_proj"),
                                         mlp + ("shared_expert",), (), d, cfg.shared_expert_intermediate_size))
            table[f"{moe}.shared_expert_gate.weight"] = TensorTarget(mlp + ("shared_expert_gate", "kernel"), (),
                                                                     True, (1, d))
    return table
