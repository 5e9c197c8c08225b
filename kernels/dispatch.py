"""The one public entry point: validate shapes/dtypes, pick a backend, call it."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmoe.kernels.activations import get_activation
from jmoe.kernels.float_bits import float_leaves, is_float_bits, plain
from jmoe.kernels.pallas_grouped import moe_ffn_pallas
from jmoe.kernels.quantized import QuantizedTensor, is_quantized
from jmoe.kernels.reference import moe_ffn_reference
from jmoe.kernels.target import platform_dependent, target_compute_capability
from jmoe.kernels.triton_grouped import moe_ffn_triton
from jmoe.kernels.xla import moe_ffn_gather, moe_ffn_pairs, moe_ffn_ragged, moe_ffn_tiled


# A CPU step runs `pairs` while it has at most this many (token, choice) pairs per slot, `xla_tiled` past it: the
# same crossing on stacked weights and on per-expert arrays (ms, pairs vs xla_tiled, Zen 4 pair,
# bench/results/cpu_expert_reads_zen4.md; stacked, one layer, top-8, 64 slots of 256 x 128: 1 pair per slot 1.30
# vs 1.54, 1.5 1.91 vs 1.92; 128 slots of 256 x 96: 1 per slot 2.37 vs 2.70, 1.5 3.29 vs 3.13; per-expert arrays,
# 8 layers of 16 slots of 512 x 1024, top-2: 1 per slot 30.9 vs 36.3, 2 per slot 60.5 vs 49.5).
CPU_PAIRS_PER_SLOT = 1


def cpu_backend(num_tokens: int, top_k: int, num_slots: int) -> str:
    """The fastest measured CPU kernel for a step of `num_tokens` tokens of `top_k` choices over `num_slots`.

    A token's choices are distinct experts, so one token puts at most one pair on a slot however few the slots:
    the disk tier's one-slot rounds of a decoded token (4 pairs over 1 slot) are matrix-vector products, which
    the tiled kernel ran as tiles of 8 rows, 7 of them padding, through a bfloat16 GEMM that repacks the whole
    expert first (37.7 against 24.4 ms an expert of 2048 x 3200, Zen 3; bench/results/disk_tier_orbax.md)."""
    pairs_on_slots = min(num_tokens * top_k, num_tokens * num_slots)  # all slots together: one a token on each
    return "pairs" if pairs_on_slots <= CPU_PAIRS_PER_SLOT * num_slots else "xla_tiled"


def moe_ffn_auto(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *, activation="swiglu",
                 per_expert=None):
    """What `auto` runs, chosen by the platform the program is lowered for, then by shape.

    CUDA GPU: the Pallas grouped GEMM lowered to Triton kernels. It skips empty row tiles inside the
    kernel, so the program has no XLA conditional (a conditional makes the GPU wait for the host); it
    compiles for sm_80 to sm_90 (tested by compiling for an H100 target); shapes Triton cannot tile run
    the XLA tiled kernel, masked. Not yet measured on a GPU.
    CPU: `pairs` for steps of few (token, choice) pairs a slot (decode), else the XLA tiled kernel (cpu_backend;
    never interpret-mode Pallas, never XLA:CPU's dense ragged_dot); both read `per_expert` arrays when given.
    """
    args = (x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down)
    cpu = _IMPLS[cpu_backend(*slot_ids.shape, w_gate_up.shape[0])]
    return platform_dependent(*args, cuda=functools.partial(_IMPLS["pallas"], activation=activation),
                              default=functools.partial(cpu, activation=activation, per_expert=per_expert))


def _ids_in_range(impl):
    """`impl` with traced slot ids outside [0, S) as -1, none, so that they contribute nothing in every backend alike
    (an XLA gather would clamp them to a slot). The Pallas kernels check the range themselves: on a GPU this select
    was a kernel of its own between the router's and the grouped GEMM's."""
    def guarded(x, slot_ids, weights, w_gate_up, *rest, **options):
        in_range = (slot_ids >= 0) & (slot_ids < w_gate_up.shape[0])
        return impl(x, jnp.where(in_range, slot_ids, -1), weights, w_gate_up, *rest, **options)
    return guarded


def _on_plain_arrays(impl, *args, **kwargs):
    """`impl` on FloatBits weights as the float arrays they stand for: the Pallas and Triton kernels take refs of
    plain arrays (and a GPU slices 16-bit floats as they are, so no program there holds FloatBits)."""
    return impl(*(plain(a) for a in args), **kwargs)


_IMPLS = {
    "auto": moe_ffn_auto,  # chosen by the lowering platform (see moe_ffn_auto)
    "reference": _ids_in_range(moe_ffn_reference),  # gather per (token, j) + einsum, HIGHEST: the oracle
    "gather": _ids_in_range(moe_ffn_gather),  # decode: each needed slot read once, small dense products
    "xla": _ids_in_range(moe_ffn_ragged),  # prefill: sort by slot + lax.ragged_dot
    "xla_tiled": _ids_in_range(moe_ffn_tiled),  # prefill: sorted row tiles, one scan step per tile
    "pairs": _ids_in_range(moe_ffn_pairs),  # decode on CPU: a loop of one matrix-vector FFN per (token, choice)
    "pallas": functools.partial(_on_plain_arrays, moe_ffn_pallas),  # Pallas grouped GEMM (Triton lowering on GPU)
    "triton": _ids_in_range(functools.partial(_on_plain_arrays, moe_ffn_triton)),  # Triton via jax-triton, GPU only
}
BACKENDS = tuple(_IMPLS)
# The backends that read `per_expert` arrays (on CPU); the others read the stacked weights, which hold the
# same values.
PER_EXPERT_BACKENDS = ("auto", "xla_tiled", "pairs")
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _as_arrays(weight):
    """A weight's arrays as JAX arrays (QuantizedTensor and FloatBits leaf by leaf); None stays None."""
    if weight is None:
        return None
    return jax.tree.map(jnp.asarray, weight) if is_quantized(weight) or is_float_bits(weight) else jnp.asarray(weight)


def validate_inputs(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None):
    """Raise ValueError saying what was expected and what was found."""

    def fail(msg):
        raise ValueError(f"moe_ffn: {msg}")

    for name, arr, rank in (
        ("x", x, 2),
        ("slot_ids", slot_ids, 2),
        ("weights", weights, 2),
        ("w_gate_up", w_gate_up, 3),
        ("w_down", w_down, 3),
    ):
        if arr.ndim != rank:
            fail(f"{name} must have rank {rank}, got shape {tuple(arr.shape)}")
    t, d = x.shape
    s, d_gu, two_f = w_gate_up.shape
    if slot_ids.shape[0] != t:
        fail(f"slot_ids must be [T={t}, k], got {tuple(slot_ids.shape)}")
    if weights.shape != slot_ids.shape:
        fail(f"weights must match slot_ids {tuple(slot_ids.shape)}, got {tuple(weights.shape)}")
    if d_gu != d:
        fail(f"w_gate_up must be [S, d={d}, 2f], got {tuple(w_gate_up.shape)}")
    if two_f % 2:
        fail(f"w_gate_up last axis must be 2*f (gate then up), got odd {two_f}")
    f = two_f // 2
    if w_down.shape != (s, f, d):
        fail(f"w_down must be [S={s}, f={f}, d={d}], got {tuple(w_down.shape)}")
    if slot_ids.dtype != jnp.int32:
        fail(f"slot_ids must be int32, got {slot_ids.dtype}")
    if x.dtype not in _FLOAT_DTYPES:
        fail(f"x must be float32 or bfloat16, got {x.dtype}")
    quantized = [is_quantized(w) for w in (w_gate_up, w_down)]
    if quantized[0] != quantized[1] or (all(quantized) and (w_gate_up.fmt, w_gate_up.group) != (w_down.fmt, w_down.group)):
        fail("w_gate_up and w_down must be both plain or both QuantizedTensors of one format, got "
             f"{w_gate_up!r} and {w_down!r}")
    for name, arr in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        # Plain weights in the other float dtype are cast slot by slot, as quantized ones are dequantized.
        if not is_quantized(arr) and arr.dtype not in _FLOAT_DTYPES:
            fail(f"{name} must be float32, bfloat16 or a jmoe.kernels.QuantizedTensor, got {arr.dtype}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        fail(f"weights must be floating point, got {weights.dtype}")
    for name, bias, shape in (("b_gate_up", b_gate_up, (s, two_f)), ("b_down", b_down, (s, d))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype not in _FLOAT_DTYPES):
            fail(f"{name} must be None or float32/bfloat16 {list(shape)} (one bias row per slot), got "
                 f"{bias.dtype} {list(bias.shape)}")


def validate_per_expert(per_expert, stacked: "ExpertWeights") -> tuple:
    """per_expert as a tuple of S ExpertWeights (JAX arrays) shaped like one expert of `stacked` each; else
    ValueError saying what was expected and what was found."""

    def layout(tree):
        return (jax.tree.structure(tree, is_leaf=is_float_bits),
                [(tuple(a.shape), jnp.dtype(a.dtype)) for a in float_leaves(tree)])

    structure, leaves = layout(stacked)
    one = structure, [((1, *shape[1:]), dtype) for shape, dtype in leaves]
    parts = tuple(per_expert)
    if len(parts) != stacked.num_experts:
        raise ValueError(f"moe_ffn: per_expert must hold one ExpertWeights per slot ({stacked.num_experts}), got "
                         f"{len(parts)}")
    for index, part in enumerate(parts):
        if not isinstance(part, ExpertWeights) or layout(part) != one:
            raise ValueError(f"moe_ffn: per_expert[{index}] must be slot {index}'s weights with a leading axis of 1, "
                             f"leaves {one[1]}, got {layout(part)[1]} in {type(part).__name__}")
    return tuple(jax.tree.map(jnp.asarray, part) for part in parts)


def moe_ffn(x, slot_ids, weights, w_gate_up, w_down, *, b_gate_up=None, b_down=None, backend="auto",
            activation="swiglu", out_dtype=None, per_expert=None):
    """y[t] = sum_j weights[t, j] * (act(x_t Wg + bg, x_t Wu + bu) Wd + bd) for slot slot_ids[t, j].

    x [T, d]; slot_ids int32 [T, k] (-1 contributes nothing and is never read);
    weights [T, k]; w_gate_up [S, d, 2f] (gate then up); w_down [S, f, d], each a float array or a
    QuantizedTensor (dequantized slot by slot or tile by tile inside the kernel, jmoe.kernels.quantized);
    optional biases b_gate_up [S, 2f] and b_down [S, d] (GPT-OSS).
    per_expert: optional, the same S experts once more, one ExpertWeights with [1, ...] leaves each, e.g. views
    of the stacked arrays' buffers (jmoe.kernels.per_expert_views); the CPU kernels `pairs` and `xla_tiled`
    (so `auto`) read these in place, because XLA:CPU copies a slice of a stacked array before a dot reads it.
    Returns [T, d] accumulated in float32 and cast to out_dtype (default x.dtype). Callers that add up
    several partial results ask for float32, so rounding happens once, after the sum.
    Inputs may be JAX or NumPy arrays (or nested lists); NumPy's float64 becomes float32 as in jnp.asarray.
    """
    # A backend chosen by platform traces every branch, which NumPy inputs cannot enter: convert once.
    x, slot_ids, weights = (jnp.asarray(a) for a in (x, slot_ids, weights))
    w_gate_up, w_down, b_gate_up, b_down = (_as_arrays(w) for w in (w_gate_up, w_down, b_gate_up, b_down))
    validate_inputs(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down)
    if per_expert is not None:
        per_expert = validate_per_expert(per_expert, ExpertWeights(w_gate_up, w_down, b_gate_up, b_down))
    num_slots = w_gate_up.shape[0]
    if not isinstance(slot_ids, jax.core.Tracer) and bool(((slot_ids < -1) | (slot_ids >= num_slots)).any()):
        raise ValueError(f"moe_ffn: slot_ids must be in [-1, {num_slots}) (-1 = none), found "
                         f"[{int(slot_ids.min())}, {int(slot_ids.max())}]")
    get_activation(activation)
    if backend not in BACKENDS:
        raise ValueError(f"moe_ffn: unknown backend {backend!r}; expected one of {BACKENDS}")
    y = _traced_once_per_shape(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down,
                               per_expert if backend in PER_EXPERT_BACKENDS else None, backend=backend,
                               activation=activation, target=target_compute_capability())  # f32
    return y.astype(out_dtype or x.dtype)


@functools.partial(jax.jit, static_argnames=("backend", "activation", "target"))
def _traced_once_per_shape(x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, per_expert, *, backend,
                           activation, target):
    """The backend's kernel, jitted: a step calls it in every MoE layer with the same shapes, and JAX traces and
    lowers a jitted function once per shapes and program (its calls share one function, which XLA inlines), where
    it traced and lowered the kernel once per layer. `target` (the GPU compiled for, jmoe.kernels.target) is in the
    key because the kernel's trace depends on it."""
    del target
    options = {"per_expert": per_expert} if backend in PER_EXPERT_BACKENDS else {}
    return _IMPLS[backend](x, slot_ids, weights, w_gate_up, w_down, b_gate_up, b_down, activation=activation,
                           **options)


def moe_ffn_from_sources(x, weights, sources, *, activation="swiglu"):
    """float32 [1, d]: the expert FFN of a one-row step whose choices lie in several sources, each (slot_ids [1, k],
    ExpertWeights): a choice is read from the first source whose slot ids name a slot for it (an id in [0, S) of that
    source's S), all in the Pallas grouped GEMM's two kernels (Triton on a GPU: miss mode "direct" reads the cache
    slots' experts and the pinned-host ones in one gate-up and one down kernel, where one call a source made two of
    each and a sum); interpreted elsewhere (tests)."""
    # Each as moe_ffn_pallas takes a source: (slot_ids, w_gate_up, w_down, b_gate_up, b_down).
    flat = tuple((ids, experts.w_gate_up, experts.w_down, experts.b_gate_up, experts.b_down)
                 for ids, experts in sources)
    for source in flat:
        validate_inputs(x, source[0], weights, *source[1:])
    if x.shape[0] != 1:
        raise ValueError(f"moe_ffn_from_sources: a one-row step's experts; got x of {x.shape[0]} rows")
    return _sources_traced_once(x, weights, flat, activation=activation, target=target_compute_capability())


@functools.partial(jax.jit, static_argnames=("activation", "target"))
def _sources_traced_once(x, weights, sources, *, activation, target):
    """moe_ffn_from_sources's kernels, jitted as `_traced_once_per_shape` is, for the same reason."""
    del target
    (slot_ids, *first), *rest = [(ids, *map(plain, leaves)) for ids, *leaves in sources]
    return moe_ffn_pallas(x, slot_ids, weights, *first, activation=activation, also=tuple(rest))


class ExpertWeights(NamedTuple):
    """The stacked weights of S experts (or slots), a pytree whose every leaf has the expert axis first, so
    that copying, slicing or updating one expert is the same operation on every leaf (of the stacked arrays:
    `per_expert`, only for experts read in place on a CPU, resident or offloaded, never for slots, holds the same
    experts one per array, jmoe.kernels.per_expert_views)."""

    w_gate_up: jax.Array | QuantizedTensor  # [S, d, 2f]: gate then up on the last axis
    w_down: jax.Array | QuantizedTensor  # [S, f, d]
    b_gate_up: jax.Array | None = None  # [S, 2f]: expert biases (GPT-OSS); None = none
    b_down: jax.Array | None = None  # [S, d]
    per_expert: tuple | None = None  # S ExpertWeights with [1, ...] leaves: views of the leaves above

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def stacked(self) -> "ExpertWeights":
        """The same experts without their per-expert views: what slicing, copying or zero-filling per leaf takes."""
        return self._replace(per_expert=None)


class ExpertKernel(NamedTuple):
    """A backend and an activation bound together: how one model computes its expert FFNs."""

    backend: str
    activation: str

    def __call__(self, x, slot_ids, weights, experts: ExpertWeights, out_dtype=None):
        return moe_ffn(x, slot_ids, weights, experts.w_gate_up, experts.w_down, b_gate_up=experts.b_gate_up,
                       b_down=experts.b_down, backend=self.backend, activation=self.activation, out_dtype=out_dtype,
                       per_expert=experts.per_expert)
