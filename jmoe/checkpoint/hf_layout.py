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
    """Where one HF tensor lands: param[index] = tensor.T if transpose else tensor (with `deinterleave`, the
    last axis's (gate, up) pairs are first split into a gate half and an up half)."""

    param: ParamPath
    index: tuple  # ints and slices into the jmoe parameter; () = the whole parameter
    transpose: bool
    hf_shape: tuple[int, ...]
    deinterleave: bool = False  # GPT-OSS stores gate and up columns alternating


# Per family: the MoE block's module name and the expert projection names for (gate, up, down).
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "gpt_oss": ("mlp", None),  # stacked experts: _stacked_expert_targets
}

# Names a checkpoint may carry that jmoe deliberately does not load, with the reason.
IGNORABLE = {
    "lm_head.weight": "tie_word_embeddings is true: the output head is the input embedding",
}


def is_ignorable(cfg: ModelConfig, name: str) -> bool:
    """A tensor jmoe does not load: the untied head of a tied model, or a multi-token-prediction layer
    (`model.layers.N` for N past num_hidden_layers, as DeepSeek-V3 ships them: jmoe predicts one token)."""
    if name in IGNORABLE:
        return cfg.tie_word_embeddings
    parts = name.split(".")
    return (cfg.extra_layers > 0 and len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and cfg.num_layers <= int(parts[2]) < cfg.num_layers + cfg.extra_layers)


def _swiglu_targets(prefix: str, names: tuple[str, str, str], param: ParamPath, lead: tuple,
                    d: int, f: int) -> dict[str, TensorTarget]:
    """gate/up/down projections ([f, d], [f, d], [d, f] in HF) into fused w_gate_up and w_down: a dense MLP's (`lead`
    empty) as HF stores them, [2f, d] and [d, f]; expert `lead` of stacked experts transposed, [.., d, 2f] and
    [.., f, d], as the grouped GEMM kernels read them."""
    gate, up, down = names
    experts = bool(lead)

    def half(i: int) -> tuple:
        rows = slice(i * f, (i + 1) * f)
        return lead + (slice(None), rows) if experts else (rows,)

    return {
        f"{prefix}.{gate}.weight": TensorTarget(param + ("w_gate_up",), half(0), experts, (f, d)),
        f"{prefix}.{up}.weight": TensorTarget(param + ("w_gate_up",), half(1), experts, (f, d)),
        f"{prefix}.{down}.weight": TensorTarget(param + ("w_down",), lead, experts, (d, f)),
    }


def _linear(table: dict, name: str, param: ParamPath, n_in: int, n_out: int, bias: bool) -> None:
    table[f"{name}.weight"] = TensorTarget(param + ("kernel",), (), False, (n_out, n_in))
    if bias:
        table[f"{name}.bias"] = TensorTarget(param + ("bias",), (), False, (n_out,))


def _norm(table: dict, name: str, param: ParamPath, dim: int) -> None:
    table[f"{name}.weight"] = TensorTarget(param + ("scale",), (), False, (dim,))


def _gqa_targets(cfg: ModelConfig, pre: str, attn: ParamPath) -> dict[str, TensorTarget]:
    d, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    table: dict[str, TensorTarget] = {}
    for proj, (n_in, n_out) in {"q": (d, q_out), "k": (d, kv_out), "v": (d, kv_out), "o": (q_out, d)}.items():
        _linear(table, f"{pre}.{proj}_proj", attn + (proj,), n_in, n_out, cfg.o_bias if proj == "o" else cfg.qkv_bias)
    if cfg.qk_norm != "none":
        q_dim, k_dim = (hd, hd) if cfg.qk_norm == "per_head" else (q_out, kv_out)
        _norm(table, f"{pre}.q_norm", attn + ("q_norm",), q_dim)
        _norm(table, f"{pre}.k_norm", attn + ("k_norm",), k_dim)
    return table


def _mla_targets(cfg: ModelConfig, pre: str, attn: ParamPath) -> dict[str, TensorTarget]:
    """transformers' DeepseekV3Attention names; attention_bias gives q_a, kv_a and o a bias."""
    m, d, h = cfg.mla, cfg.hidden_size, cfg.num_heads
    q_out = h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    table: dict[str, TensorTarget] = {}
    if m.q_lora_rank:
        _linear(table, f"{pre}.q_a_proj", attn + ("q_a",), d, m.q_lora_rank, cfg.qkv_bias)
        _norm(table, f"{pre}.q_a_layernorm", attn + ("q_a_norm",), m.q_lora_rank)
        _linear(table, f"{pre}.q_b_proj", attn + ("q_b",), m.q_lora_rank, q_out, False)
    else:
        _linear(table, f"{pre}.q_proj", attn + ("q",), d, q_out, False)
    _linear(table, f"{pre}.kv_a_proj_with_mqa", attn + ("kv_a",), d, m.kv_lora_rank + m.qk_rope_head_dim,
            cfg.qkv_bias)
    _norm(table, f"{pre}.kv_a_layernorm", attn + ("kv_a_norm",), m.kv_lora_rank)
    _linear(table, f"{pre}.kv_b_proj", attn + ("kv_b",), m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim),
            False)
    _linear(table, f"{pre}.o_proj", attn + ("o",), h * m.v_head_dim, d, cfg.o_bias)
    return table


def _stacked_expert_targets(cfg: ModelConfig, moe: str, mlp: ParamPath) -> dict[str, TensorTarget]:
    """GPT-OSS: every expert of a layer in one tensor per projection ([E, in, out], gate and up alternating on
    the last axis), with biases, and a router with a bias."""
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    experts = mlp + ("experts",)
    table: dict[str, TensorTarget] = {}
    _linear(table, f"{moe}.router", mlp + ("router",), d, e, True)
    table[f"{moe}.experts.gate_up_proj"] = TensorTarget(experts + ("w_gate_up",), (), False, (e, d, 2 * f), True)
    table[f"{moe}.experts.gate_up_proj_bias"] = TensorTarget(experts + ("b_gate_up",), (), False, (e, 2 * f), True)
    table[f"{moe}.experts.down_proj"] = TensorTarget(experts + ("w_down",), (), False, (e, f, d))
    table[f"{moe}.experts.down_proj_bias"] = TensorTarget(experts + ("b_down",), (), False, (e, d))
    return table


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorTarget]:
    """Every tensor name a checkpoint of this config must contain, with its target and HF shape."""
    d = cfg.hidden_size
    moe_name, expert_names = _MOE_NAMES[cfg.family]
    table: dict[str, TensorTarget] = {
        "model.embed_tokens.weight": TensorTarget(("embed",), (), False, (cfg.vocab_size, d)),
        "model.norm.weight": TensorTarget(("final_norm", "scale"), (), False, (d,)),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = TensorTarget(("lm_head",), (), False, (cfg.vocab_size, d))
    for i in range(cfg.num_layers):
        pre, layer = f"model.layers.{i}", ("layers", i)
        table[f"{pre}.input_layernorm.weight"] = TensorTarget(layer + ("input_norm", "scale"), (), False, (d,))
        table[f"{pre}.post_attention_layernorm.weight"] = TensorTarget(layer + ("post_norm", "scale"), (), False, (d,))
        table.update((_mla_targets if cfg.mla else _gqa_targets)(cfg, f"{pre}.self_attn", layer + ("attn",)))
        if cfg.attention_sinks:
            table[f"{pre}.self_attn.sinks"] = TensorTarget(layer + ("attn", "sinks"), (), False, (cfg.num_heads,))
        mlp = layer + ("mlp",)
        if not cfg.moe_layers[i]:
            table.update(_swiglu_targets(f"{pre}.mlp", ("gate_proj", "up_proj", "down_proj"), mlp, (),
                                         d, cfg.dense_intermediate_size))
            continue
        moe = f"{pre}.{moe_name}"
        if expert_names is None:
            table.update(_stacked_expert_targets(cfg, moe, mlp))
            continue
        table[f"{moe}.gate.weight"] = TensorTarget(mlp + ("router", "kernel"), (), False, (cfg.num_experts, d))
        if cfg.router == "sigmoid_grouped":
            table[f"{moe}.gate.e_score_correction_bias"] = TensorTarget(mlp + ("router", "score_bias"), (), False,
                                                                        (cfg.num_experts,))
        for e in range(cfg.num_experts):
            table.update(_swiglu_targets(f"{moe}.experts.{e}", expert_names, mlp + ("experts",), (e,),
                                         d, cfg.expert_intermediate_size))
        if cfg.shared_expert_intermediate_size:
            shared = "shared_expert" if cfg.shared_expert_gate else "shared_experts"  # Qwen2-MoE vs DeepSeek
            table.update(_swiglu_targets(f"{moe}.{shared}", ("gate_proj", "up_proj", "down_proj"),
                                         mlp + ("shared_expert",), (), d, cfg.shared_expert_intermediate_size))
            if cfg.shared_expert_gate:
                table[f"{moe}.shared_expert_gate.weight"] = TensorTarget(mlp + ("shared_expert_gate", "kernel"), (),
                                                                         False, (1, d))
    return table
