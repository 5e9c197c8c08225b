"""Model configuration: a frozen, hashable description parsed from a Hugging Face config.json.

Per-family differences live in `FAMILIES`, one `Family` entry per `model_type`: the config keys it
uses and the few architectural switches (router normalisation, q/k norm, biases, shared expert).
A new family is a new entry plus whatever new switch it needs; `ALIASES` maps model types that share an
architecture onto one family (Kimi K2 is DeepSeek-V3).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from jmoe.arguments import checked_expert_dtype
from jmoe.config_rope import Yarn, rope_settings
from jmoe.config_values import SIZE_LIMITS, boolean as _bool, positive_float as _positive_float, size as _size
from jmoe.errors import ConfigError, InputError
from jmoe.jsonfile import read_json
from jmoe.kernels import FORMATS, quantized
from jmoe.kernels.activations import activation_name

SUPPORTED_QUANT_METHODS = ("fp8", "mxfp4")
MLA_NORM_EPS = 1e-6  # transformers builds DeepSeek's q_a / kv_a RMSNorms with their default eps, not rms_norm_eps


@dataclasses.dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention."""

    q_lora_rank: int  # 0: a plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dimensions come as interleaved pairs
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale_all_dim correction squared


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs to know, static and hashable (usable as a jit static argument)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_linear_factor: float  # 1.0 unless rope_type == "linear"
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    dense_intermediate_size: int  # width of the plain MLP in layers that are not MoE
    moe_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP (False)
    sliding_windows: tuple[int | None, ...]  # per layer: attention window, None = full
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    qk_norm: str = "none"  # "none" | "per_head" (RMSNorm over head_dim) | "full" (over the projection)
    expert_activation: str = "swiglu"  # a jmoe.kernels ACTIVATIONS name, passed to every expert computation
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    rotary_dim: int | None = None  # leading dimensions of each head that are rotated; None = head_dim
    rope_yarn: Yarn | None = None
    mla: MLA | None = None  # None: grouped-query attention
    router: str = "softmax"  # "softmax" | "sigmoid_grouped" (DeepSeek-V3: biased selection within groups)
    n_group: int = 1  # sigmoid_grouped: experts fall into n_group groups, the best topk_group are eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # sigmoid_grouped: multiplies the routed experts' weights
    shared_expert_gate: bool = True  # the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE)
    extra_layers: int = 0  # decoder layers past num_hidden_layers a checkpoint may carry (multi-token prediction)
    fp8_block: tuple[int, int] | None = None  # float8 weights with per-block inverse scales of this shape
    mxfp4_experts: bool = False  # the checkpoint's experts are MXFP4 blocks and scales (GPT-OSS)
    router_bias: bool = False  # the router's logits have a bias (GPT-OSS)
    expert_bias: bool = False  # every expert's projections have biases (GPT-OSS)
    attention_sinks: bool = False  # a learned per-head logit joins every softmax and takes its share (GPT-OSS)
    # How routed experts are stored (a load option, not part of config.json): None = like every other
    # parameter; "float32" / "bfloat16"; or a jmoe.kernels.quantized format with its group size.
    expert_dtype: str | None = None
    expert_group: int = 0

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _sparse_layers(hf: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style layer selection: MoE every `decoder_sparse_step` layers except `mlp_only_layers`."""
    step = _size(hf, "decoder_sparse_step", "config.json", 1, limit_key="num_hidden_layers")
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, found {mlp_only!r}")
    mlp_only = set(mlp_only)
    return tuple(num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))


def _all_moe(hf: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    return (True,) * num_layers


def _first_k_dense(hf: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """DeepSeek-style: the first `first_k_dense_replace` layers are dense, the rest MoE (transformers reads no
    other key; `moe_layer_freq` in some configs is not used by it either)."""
    dense = _size(hf, "first_k_dense_replace", "config.json", low=0, limit_key="num_hidden_layers")
    return tuple(i >= dense for i in range(num_layers))


def _sliding_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if type(window) is int and window == 0:  # some configs write 0 for "no window"
        window = None
    if window is not None:
        window = _size(hf, "sliding_window", "config.json", limit_key="max_position_embeddings")
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers or not all(
                isinstance(t, str) for t in layer_types):
            raise ConfigError(f"config.json: layer_types must list one attention type per layer ({num_layers}), "
                              f"found {layer_types!r}")
        return tuple(window if t == "sliding_attention" and window else None for t in layer_types)
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return (None,) * num_layers
    return (window if window else None,) * num_layers


def _clamped_swiglu(hf: dict, source: str) -> str:
    """GPT-OSS's expert activation with its config's limit and gain."""
    return activation_name("clamped_swiglu", limit=_positive_float(hf, "swiglu_limit", source, 7.0),
                           alpha=_positive_float(hf, "swiglu_alpha", source, 1.702))


@dataclasses.dataclass(frozen=True)
class Family:
    """How one `model_type` spells its config and which architectural switches it uses."""

    num_experts_keys: tuple[str, ...]  # the first one present is used
    expert_width_key: str
    moe_layers: Callable[[dict, int, int], tuple[bool, ...]]
    norm_topk_prob: Callable[[dict], bool]
    qk_norm: str | Callable[[dict], str] = "none"
    qkv_bias: Callable[[dict], bool] = lambda hf: bool(hf.get("attention_bias", False))
    o_bias: Callable[[dict], bool] = lambda hf: bool(hf.get("attention_bias", False))
    has_shared_expert: bool = False
    # DeepSeek-style MoE: a sigmoid router with grouped, bias-corrected selection, and `n_shared_experts`
    # ungated shared experts of the routed experts' width; `defaults` are transformers' for missing keys.
    deepseek_moe: bool = False
    mla: bool = False
    partial_rotary_default: float | None = None  # rotate only part of each head (GLM-4.5); None: all of it
    defaults: tuple[tuple[str, Any], ...] = ()
    # GPT-OSS: router and expert biases, attention sinks, and the activation's name (jmoe.kernels.activations)
    router_bias: bool = False
    expert_bias: bool = False
    attention_sinks: bool = False
    expert_activation: Callable[[dict, str], str] = lambda hf, source: "swiglu"


FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        num_experts_keys=("num_local_experts",), expert_width_key="intermediate_size",
        moe_layers=_all_moe, norm_topk_prob=lambda hf: True,
        qkv_bias=lambda hf: False, o_bias=lambda hf: False),
    "qwen2_moe": Family(
        num_experts_keys=("num_experts", "num_local_experts"), expert_width_key="moe_intermediate_size",
        moe_layers=_sparse_layers, norm_topk_prob=lambda hf: bool(hf.get("norm_topk_prob", False)),
        qkv_bias=lambda hf: bool(hf.get("qkv_bias", True)), o_bias=lambda hf: False,
        has_shared_expert=True),
    "qwen3_moe": Family(
        num_experts_keys=("num_experts", "num_local_experts"), expert_width_key="moe_intermediate_size",
        moe_layers=_sparse_layers, norm_topk_prob=lambda hf: bool(hf.get("norm_topk_prob", False)),
        qk_norm="per_head"),
    "olmoe": Family(
        num_experts_keys=("num_experts", "num_local_experts"), expert_width_key="intermediate_size",
        moe_layers=_all_moe, norm_topk_prob=lambda hf: bool(hf.get("norm_topk_prob", False)),
        qk_norm="full"),
    "deepseek_v3": Family(
        num_experts_keys=("n_routed_experts", "num_local_experts"), expert_width_key="moe_intermediate_size",
        moe_layers=_first_k_dense, norm_topk_prob=lambda hf: bool(hf["norm_topk_prob"]),
        deepseek_moe=True, mla=True,
        defaults=(("n_group", 8), ("topk_group", 4), ("routed_scaling_factor", 2.5), ("first_k_dense_replace", 3),
                  ("n_shared_experts", 1), ("norm_topk_prob", True), ("rope_interleave", True))),
    "glm4_moe": Family(
        num_experts_keys=("n_routed_experts", "num_local_experts"), expert_width_key="moe_intermediate_size",
        moe_layers=_first_k_dense, norm_topk_prob=lambda hf: bool(hf["norm_topk_prob"]),
        qk_norm=lambda hf: "per_head" if hf.get("use_qk_norm") else "none", o_bias=lambda hf: False,
        deepseek_moe=True, partial_rotary_default=0.5,
        defaults=(("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0), ("first_k_dense_replace", 1),
                  ("n_shared_experts", 1), ("norm_topk_prob", True))),
    "gpt_oss": Family(
        num_experts_keys=("num_local_experts", "num_experts"), expert_width_key="intermediate_size",
        moe_layers=_all_moe, norm_topk_prob=lambda hf: True,  # a softmax over the top-k logits
        router_bias=True, expert_bias=True, attention_sinks=True, expert_activation=_clamped_swiglu,
        defaults=(("swiglu_limit", 7.0), ("swiglu_alpha", 1.702), ("attention_bias", True))),
}
# model_type -> the family whose architecture and checkpoint names it shares
ALIASES = {"kimi_k2": "deepseek_v3"}


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: eos_token_id must be a token id or a list of them, found {value!r}; fix it")
    return tuple(values)


def parse_config(hf: dict, source: str = "config.json", generation: dict | None = None) -> ModelConfig:
    """Build a ModelConfig from a parsed HF config dict (and optional generation_config dict)."""
    try:
        return _parse_config(hf, source, generation)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        # A value of the wrong kind that no specific check names: still the file's fault, said as such.
        raise ConfigError(f"{source}: a value has the wrong type or form ({type(e).__name__}: {e}); compare it with "
                          f"the config.json the model was saved with") from e


def _rotary_dim(hf: dict, fam: Family, head_dim: int, source: str) -> int | None:
    """How many leading dimensions of a head are rotated (GLM-4.5's partial_rotary_factor); None = all."""
    if fam.partial_rotary_default is None:
        return None
    params = hf.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    factor = _positive_float({"partial_rotary_factor": value}, "partial_rotary_factor", source,
                             fam.partial_rotary_default)
    dim = int(head_dim * factor)
    if factor > 1 or dim < 2 or dim % 2:
        raise ConfigError(f"{source}: partial_rotary_factor {value!r} gives {dim} rotated dimensions of head_dim "
                          f"{head_dim}; expected a factor <= 1 giving an even number >= 2; fix config.json")
    return dim


def _mla(hf: dict, source: str, softmax_mult: float) -> MLA:
    if "q_lora_rank" not in hf:
        raise ConfigError(f"{source}: missing required key 'q_lora_rank' (null for a plain q projection) for "
                          f"model_type {hf.get('model_type')!r}; add it to config.json")
    q_lora = 0 if hf["q_lora_rank"] is None else _size(hf, "q_lora_rank", source, limit_key="lora_rank")
    nope = _size(hf, "qk_nope_head_dim", source, limit_key="head_dim")
    rope = _size(hf, "qk_rope_head_dim", source, limit_key="head_dim")
    if rope % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim must be even (rotary pairs), found {rope}; fix config.json")
    return MLA(q_lora_rank=q_lora, kv_lora_rank=_size(hf, "kv_lora_rank", source, limit_key="lora_rank"),
               qk_nope_head_dim=nope, qk_rope_head_dim=rope,
               v_head_dim=_size(hf, "v_head_dim", source, limit_key="head_dim"),
               rope_interleave=_bool(hf, "rope_interleave", source),
               softmax_scale=(nope + rope) ** -0.5 * softmax_mult)


def _grouped_router(hf: dict, num_experts: int, top_k: int, source: str) -> dict:
    """n_group, topk_group and routed_scaling_factor, checked the way transformers will use them: equal groups
    of at least two experts (a group's score is its best two), enough eligible experts for top-k."""
    n_group = _size(hf, "n_group", source)
    topk_group = _size(hf, "topk_group", source, limit_key="n_group")
    if num_experts % n_group or num_experts // n_group < 2:
        raise ConfigError(f"{source}: n_group ({n_group}) must split the {num_experts} routed experts into equal "
                          f"groups of at least 2; fix config.json")
    if topk_group > n_group or top_k > topk_group * (num_experts // n_group):
        raise ConfigError(f"{source}: topk_group ({topk_group}) must be <= n_group ({n_group}) and its groups must "
                          f"hold num_experts_per_tok ({top_k}) experts; fix config.json")
    return dict(router="sigmoid_grouped", n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=_positive_float(hf, "routed_scaling_factor", source, 1.0))


def _quant_method(hf: dict, source: str) -> str | None:
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, found {quant!r}; fix config.json")
    method = quant.get("quant_method")
    if method not in SUPPORTED_QUANT_METHODS:
        raise ConfigError(f"{source}: unsupported quantization_config.quant_method {method!r}; supported: "
                          f"{', '.join(SUPPORTED_QUANT_METHODS)} (block-scaled float8 weights, MXFP4 experts); use "
                          f"an unquantized checkpoint or one of these")
    if method == "mxfp4" and hf.get("model_type") != "gpt_oss":
        raise ConfigError(f"{source}: quantization_config.quant_method 'mxfp4' is read for gpt_oss checkpoints only "
                          f"(stacked expert blocks and scales), found model_type {hf.get('model_type')!r}")
    return method


def _fp8_block(hf: dict, source: str) -> tuple[int, int]:
    """quantization_config.weight_block_size of an fp8 checkpoint (default 128 x 128)."""
    quant = hf["quantization_config"]
    block = quant.get("weight_block_size", [128, 128])
    if not isinstance(block, list) or len(block) != 2:
        raise ConfigError(f"{source}: quantization_config.weight_block_size must be [rows, columns], found "
                          f"{block!r}; fix config.json")
    rows, cols = (_size({"quantization_config.weight_block_size": v}, "quantization_config.weight_block_size",
                        source, limit_key="fp8_block") for v in block)
    return rows, cols


def _parse_config(hf: dict, source: str, generation: dict | None) -> ModelConfig:
    model_type = hf.get("model_type")
    family = ALIASES.get(model_type, model_type)
    if family not in FAMILIES:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; supported model types: "
                          f"{', '.join(sorted([*FAMILIES, *ALIASES]))}")
    fam = FAMILIES[family]
    hf = {**hf, **{key: value for key, value in fam.defaults if hf.get(key) is None}}
    hidden = _size(hf, "hidden_size", source)
    num_layers = _size(hf, "num_hidden_layers", source)
    num_heads = _size(hf, "num_attention_heads", source)
    num_kv_heads = _size(hf, "num_key_value_heads", source, num_heads)
    head_dim = _size(hf, "head_dim", source, max(hidden // num_heads, 1))
    experts_key = next((k for k in fam.num_experts_keys if hf.get(k) is not None), fam.num_experts_keys[0])
    num_experts = _size(hf, experts_key, source, limit_key="experts")
    top_k = _size(hf, "num_experts_per_tok", source)
    if num_heads % num_kv_heads and not fam.mla:  # MLA has no KV heads: its keys come from one latent
        raise ConfigError(f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                          f"num_key_value_heads ({num_kv_heads})")
    if not 0 < top_k <= num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok must be in 1..{experts_key} "
                          f"({num_experts}), found {top_k}")
    theta, linear_factor, yarn, softmax_mult = rope_settings(hf, source)
    eos = _eos_ids(hf.get("eos_token_id"), source)
    if generation is not None and generation.get("eos_token_id") is not None:
        eos = tuple(dict.fromkeys(eos + _eos_ids(generation["eos_token_id"], "generation_config.json")))
    vocab = _size(hf, "vocab_size", source)
    eos = tuple(e for e in eos if 0 <= e < vocab)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if not isinstance(dtype, str):
        raise ConfigError(f"{source}: dtype must be a dtype name such as 'bfloat16', found {dtype!r}; fix config.json")
    expert_width = _size(hf, fam.expert_width_key, source, limit_key="expert_width")
    mla = _mla(hf, source, softmax_mult) if fam.mla else None
    if mla is not None:  # as transformers: the rotary tables span the rotated part of a head
        head_dim = mla.qk_rope_head_dim
    family_switches: dict[str, Any] = {}
    if fam.deepseek_moe:
        shared = _size(hf, "n_shared_experts", source, low=0)
        if shared * expert_width > SIZE_LIMITS["shared_expert_intermediate_size"]:
            raise ConfigError(f"{source}: n_shared_experts ({shared}) x {fam.expert_width_key} ({expert_width}) must "
                              f"be at most {SIZE_LIMITS['shared_expert_intermediate_size']}; fix config.json")
        family_switches.update(_grouped_router(hf, num_experts, top_k, source), shared_expert_gate=False,
                               shared_expert_intermediate_size=shared * expert_width,
                               extra_layers=_size(hf, "num_nextn_predict_layers", source, 0, low=0,
                                                  limit_key="num_hidden_layers"))
    elif fam.has_shared_expert:
        family_switches["shared_expert_intermediate_size"] = _size(hf, "shared_expert_intermediate_size", source,
                                                                   0, low=0)
    qk_norm = fam.qk_norm(hf) if callable(fam.qk_norm) else fam.qk_norm
    quant_method = _quant_method(hf, source)
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive_float(hf, "rms_norm_eps", source, 1e-6),
        rope_theta=theta,
        rope_linear_factor=linear_factor,
        max_position_embeddings=_size(hf, "max_position_embeddings", source),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        expert_intermediate_size=expert_width,
        dense_intermediate_size=_size(hf, "intermediate_size", source, 0, low=0),
        moe_layers=fam.moe_layers(hf, num_layers, num_experts),
        sliding_windows=_sliding_windows(hf, num_layers),
        norm_topk_prob=fam.norm_topk_prob(hf),
        qk_norm=qk_norm,
        qkv_bias=fam.qkv_bias(hf),
        o_bias=fam.o_bias(hf),
        clip_qkv=hf.get("clip_qkv"),
        eos_token_ids=eos,
        pad_token_id=hf.get("pad_token_id"),
        dtype=dtype,
        rotary_dim=_rotary_dim(hf, fam, head_dim, source),
        rope_yarn=yarn,
        mla=mla,
        fp8_block=_fp8_block(hf, source) if quant_method == "fp8" else None,
        mxfp4_experts=quant_method == "mxfp4",
        router_bias=fam.router_bias,
        expert_bias=fam.expert_bias,
        attention_sinks=fam.attention_sinks,
        expert_activation=fam.expert_activation(hf, source),
        **family_switches,
    )


def with_expert_dtype(cfg: ModelConfig, expert_dtype: str | None, group_size: int | None = None) -> ModelConfig:
    """`cfg` with its routed experts stored as `expert_dtype` (None: like the other parameters; a float dtype;
    or a quantized format, jmoe.kernels.quantized) and, for int4, `group_size` rows per scale (default 64).
    An MXFP4 checkpoint's experts stay MXFP4 unless another storage is asked for."""
    if expert_dtype is None and cfg.mxfp4_experts:
        expert_dtype = "mxfp4"
    checked_expert_dtype(expert_dtype)
    if group_size is not None and expert_dtype != "int4":
        raise InputError(f"expert_group_size applies to expert_dtype='int4' only (the other formats have fixed "
                         f"layouts), found expert_dtype={expert_dtype!r} with expert_group_size={group_size!r}")
    if expert_dtype not in FORMATS:
        return cfg.replace(expert_dtype=expert_dtype, expert_group=0)
    try:
        group = quantized.group_size(expert_dtype, group_size)
        for name, rows in (("w_gate_up (hidden_size)", cfg.hidden_size),
                           ("w_down (expert intermediate size)", cfg.expert_intermediate_size)):
            quantized.check_shape(expert_dtype, group, rows, f"expert_dtype={expert_dtype}: {name}")
    except ValueError as e:
        raise InputError(str(e)) from None
    return cfg.replace(expert_dtype=expert_dtype, expert_group=group)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json when present) from a model directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{model_dir}: no config.json found; expected a Hugging Face model directory "
                          f"containing config.json and *.safetensors (pass it with --model)")
    advice = "re-export it from the source model"
    hf = read_json(config_path, "config.json", ConfigError, advice)
    gen_path = model_dir / "generation_config.json"
    generation = read_json(gen_path, "generation_config.json", ConfigError, advice) if gen_path.is_file() else None
    return parse_config(hf, str(config_path), generation)
