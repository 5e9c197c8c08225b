"""The building blocks every family shares: linear maps, RMSNorm, the SwiGLU MLP, stacked experts.

Layout choices the offload engine and the kernels rely on: dense weights (linear kernels, the dense MLP's) are
stored [out, in], as PyTorch stores them, and applied by `project`; the experts of a MoE layer are stacked [in, out]
for the grouped GEMM kernels, `w_gate_up` [E, d, 2f] (gate then up on the last axis) and `w_down` [E, f, d].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.kernels import FORMATS, ExpertWeights, QuantizedTensor, float_bits_views, per_expert_views
from jmoe.kernels.norm import added_and_normalised
from jmoe.kernels.projection import projected_rows, read_by_kernel
from jmoe.kernels.quantized import quantized_shapes
from jmoe.kernels.target import platform_dependent

INIT_STD = 0.02


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype))


def _read_after(weight: jax.Array, x: jax.Array) -> jax.Array:
    # max(bits, INT16_MIN + isnan) is the identity (but for NaN inputs, whose products are NaN anyway), and XLA cannot
    # fold it: the weight's float32 conversion, which this fuses into, then waits for x.
    bits = jax.lax.bitcast_convert_type(weight, jnp.int16)
    total = jnp.sum(x, dtype=jnp.float32)
    low = jnp.iinfo(jnp.int16).min + jnp.isnan(total).astype(jnp.int16)
    return jax.lax.bitcast_convert_type(jnp.maximum(bits, low), weight.dtype)


def weight_for(weight: jax.Array, x: jax.Array) -> jax.Array:
    """`weight`, for a product with `x`. On CPU a 16-bit float weight is read only once `x` exists: XLA:CPU computes
    the product in float32 and converts the weight first, and its scheduler hoists every layer's conversion to the
    program's start, where all of them stay live (1.1 GB of temporaries in a 24-layer bfloat16 step)."""
    if not (jnp.issubdtype(weight.dtype, jnp.floating) and jnp.dtype(weight.dtype).itemsize == 2):
        return weight
    return platform_dependent(weight, x, cpu=_read_after, default=lambda w, _: w)


def project(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x [..., in] times a dense weight stored [out, in], plus `bias` [out]: [..., out] in x's dtype, rounded once
    from float32 products and sums (as cuBLAS computes PyTorch's linear layers).

    Each output is a row of the weight against x, which XLA:GPU compiles at decode (a vector times a matrix of under
    10M elements, which it rewrites into a multiply and a reduction) as one reduction kernel a projection, the weight
    read once; stored [in, out], the reduction runs down columns, and XLA:GPU wrote the whole product out before
    reducing it (three times the weight's bytes, a kernel more: bench/results/dense_layout_h100.md). That rewrite
    multiplies in the dot's result type: asked for float32, the products are exact, where a 16-bit result type
    rounded each to 16 bits before the sum; the kernels are the same. A larger weight a GPU reads, for a few rows,
    by one kernel of its own (`jmoe.kernels.projection`), where XLA made two."""
    if read_by_kernel(x, weight):
        return platform_dependent(x, weight, bias, cuda=_projected_by_kernel, default=projected_by_xla)
    return projected_by_xla(x, weight, bias)


def projected_by_xla(x, weight, bias=None):
    """`project`'s XLA form, whatever the weight's size."""
    y = products(x, weight)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def _projected_by_kernel(x, weight, bias):
    rows = projected_rows(x.reshape(-1, x.shape[-1]), weight, bias, on_gpu=True)
    return rows.reshape(*x.shape[:-1], weight.shape[0])


def products(x: jax.Array, weight: jax.Array) -> jax.Array:
    """`project`'s float32 sums, before its bias and rounding: x [..., in] times a weight stored [out, in]."""
    return jax.lax.dot_general(x, weight_for(weight, x), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs, (d_out, d_in), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return project(x, self.kernel[...], None if self.bias is None else self.bias[...])


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x [..., d] RMS-normalised over d, times `scale` [d]: in float32, cast back before the scale, as the reference
    implementations do."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


def added_and_normalised_by_xla(x, addend, scale, *, eps: float):
    """`added_and_normalised`'s XLA form: the sum, its norm, and its finiteness where added."""
    if addend is None:
        return x, rms_norm(x[..., :scale.shape[-1]], scale, eps), None
    x = x + addend
    return x, rms_norm(x, scale, eps), jnp.isfinite(x).all(axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype, kernel_on_gpu: bool = True):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.kernel_on_gpu = kernel_on_gpu  # False: XLA's form everywhere, where XLA fuses it with its neighbours

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim], or wider: its first dim columns, normalised (a GPU's kernel reads them in place)."""
        return self.after_adding(x, None)[1]

    def after_adding(self, x: jax.Array, addend: jax.Array | None):
        """(x + addend, that normalised, bool [...]: whether each of its rows is finite); `addend` None: (x, x
        normalised, None). x [B, T, d] (or [B, T, wider]). A step of one token a row (decode) on a GPU runs it as one
        kernel (`jmoe.kernels.norm`): XLA made the residual add and the norm three kernels there, two without an add
        (for a prompt's rows it fuses the norm's multiply into the projections' GEMMs, where the kernel would add
        one)."""
        by_kernel = functools.partial(added_and_normalised, eps=self.eps, on_gpu=True)
        by_xla = functools.partial(added_and_normalised_by_xla, eps=self.eps)
        if not self.kernel_on_gpu or x.shape[-2] != 1:
            return by_xla(x, addend, self.scale[...])
        return platform_dependent(x, addend, self.scale[...], cuda=by_kernel, default=by_xla)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The SwiGLU MLP of dense weights stored [out, in]: `w_gate_up` [2f, d] (gate rows, then up), `w_down` [d, f]."""
    gate, up = jnp.split(project(x, w_gate_up), 2, axis=-1)
    h = jax.nn.silu(gate) * up
    return project(h, w_down)


class DenseMLP(nnx.Module):
    """SwiGLU MLP with gate and up fused, used by non-MoE layers and the shared expert."""

    def __init__(self, d: int, f: int, *, dtype, rngs: nnx.Rngs):
        self.w_gate_up = normal_param(rngs, (2 * f, d), dtype)
        self.w_down = normal_param(rngs, (d, f), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu_mlp(x, self.w_gate_up[...], self.w_down[...])


class PerExpertArrays(nnx.Variable):
    """`ExpertWeights.per_expert`: the experts one per array, sharing the stacked parameters' memory
    (jmoe.kernels.per_expert_views). Not a Param: nothing saves, places or counts it."""


class FloatBitsArrays(nnx.Variable):
    """The stacked experts with their 16-bit float leaves as uint16 views (jmoe.kernels.float_bits_views), which the
    steps read and copy instead. Not a Param: nothing saves, places or counts it."""


class Experts(nnx.Module):
    """The E experts of one MoE layer, stacked. Quantized experts (`expert_dtype` one of
    jmoe.kernels.FORMATS) hold each weight as two parameters, its values (`w_gate_up`) and scales
    (`w_gate_up_scale`); they start as zeros and are filled by loading, which quantizes them. On a CPU,
    `hold_per_expert_arrays` adds views of each expert, which the CPU kernels read without copying, and of 16-bit
    float experts as their uint16 bits, which XLA:CPU slices and copies without converting them."""

    def __init__(self, e: int, d: int, f: int, *, dtype, rngs: nnx.Rngs, expert_dtype: str | None = None,
                 group: int = 0, bias: bool = False):
        self.format = expert_dtype if expert_dtype in FORMATS else None
        self.group = group
        for name, shape in (("w_gate_up", (e, d, 2 * f)), ("w_down", (e, f, d))):
            if self.format is None:
                setattr(self, name, normal_param(rngs, shape, expert_dtype or dtype))
                continue
            values_shape, values_dtype, scales_shape, scales_dtype = quantized_shapes(self.format, group, shape)
            setattr(self, name, nnx.Param(jnp.zeros(values_shape, values_dtype)))
            setattr(self, f"{name}_scale", nnx.Param(jnp.zeros(scales_shape, scales_dtype)))
        # Biases (GPT-OSS) stay in the model's dtype whatever the weights' storage.
        self.b_gate_up = nnx.Param(jnp.zeros((e, 2 * f), dtype)) if bias else None
        self.b_down = nnx.Param(jnp.zeros((e, d), dtype)) if bias else None
        self.per_expert = nnx.data(None)  # set by hold_per_expert_arrays
        self.float_bits = nnx.data(None)  # set by hold_per_expert_arrays

    def weights(self) -> ExpertWeights:
        per_expert = None if self.per_expert is None else self.per_expert.get_value()
        if self.float_bits is not None:
            return self.float_bits.get_value()._replace(per_expert=per_expert)
        # get_value, unlike [...], also works on an abstract model (shape structs), which jmoe.plan compiles.
        biases = [None if b is None else b.get_value() for b in (self.b_gate_up, self.b_down)]
        if self.format is None:
            w_gate_up, w_down = self.w_gate_up.get_value(), self.w_down.get_value()
        else:
            w_gate_up, w_down = (QuantizedTensor(getattr(self, name).get_value(),
                                                 getattr(self, f"{name}_scale").get_value(), self.format, self.group)
                                 for name in ("w_gate_up", "w_down"))
        return ExpertWeights(w_gate_up, w_down, *biases, per_expert=per_expert)

    def hold_per_expert_arrays(self) -> None:
        """Where the experts sit in a CPU device's memory and are large enough to gain from it, also hold them one
        per array (views, no memory), so that the CPU kernels read each in place; and where they are 16-bit floats
        there, their bits (views too), which the steps slice and copy. Elsewhere nothing changes."""
        self.drop_views()  # views of the parameters, never of earlier views
        views = per_expert_views(self.weights())
        self.per_expert = None if views is None else PerExpertArrays(views)
        bits = float_bits_views(self.weights())
        self.float_bits = None if bits is None else FloatBitsArrays(bits)

    def drop_views(self) -> None:
        """Forget the views hold_per_expert_arrays made: after a weight update they would hold the old values."""
        self.per_expert = None
        self.float_bits = None
