"""Quantized expert weights: the formats, the pytree that carries them through slots and copies, the
deterministic NumPy quantizer, and the dequantization every kernel applies to one slot or tile at a time.

A weight W [..., K, N] (K the input axis a token's activations are multiplied along, N the output axis)
is stored as `values` plus `scales`, and W ~= decode(values) * scale, computed in float32 and then
rounded to the activation dtype:

| format | values | scales (float32 unless said) | scale formula |
|---|---|---|---|
| int8  | int8 [..., K, N], in [-127, 127] | [..., 1, N]: one per output column | max over the column of abs(W) / 127 |
| int4  | uint8 [..., K/2, N], two per byte | [..., K/g, N]: one per group of g rows and column | group max abs(W) / 7 |
| fp8   | float8_e4m3fn bits as uint8 [..., K, N] | [..., ceil(K/128), ceil(N/128)]: per 128x128 block | block max abs(W) / 448 |
| mxfp4 | uint8 [..., K/2, N], e2m1 codes two per byte | uint8 e8m0 [..., K/32, N]: 2^(byte - 127) | 2^(floor(log2(max abs)) - 2) |

Rounding: int8 and int4 round W / scale half to even and clip to +-127 / +-7 (int4 nibbles store q + 8);
fp8 and e2m1 round to the nearest representable value, ties to even, after clipping to +-448 / +-6
(the formats' largest finite values). A group, column or block that is all zero gets scale 1 (int8, int4,
fp8) or 2^-127 (mxfp4) and zero codes. Two 4-bit codes share a byte as row r (low nibble) and row r + K/2
(high nibble): a kernel then multiplies the low nibbles with the first half of a token's activations and
the high nibbles with the second half, without interleaving rows. fp8 values are kept as their bytes (uint8),
because XLA:CPU copies and scatters float8 arrays several times slower than bytes. fp8 is DeepSeek-V3's layout (their
`weight_scale_inv` is this scale), mxfp4 the OCP microscaling format GPT-OSS ships (there the nibbles of a
byte are neighbouring values; loading repacks them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMATS = ("int8", "int4", "fp8", "mxfp4")
DEFAULT_INT4_GROUP = 64  # measured against 32 and 128 on the default model: bench/results/quantized.md
FP8_BLOCK = 128
MXFP4_GROUP = 32
_PACKED = ("int4", "mxfp4")  # two 4-bit codes per byte


_FIXED_GROUPS = {"int8": 0, "fp8": FP8_BLOCK, "mxfp4": MXFP4_GROUP}


def group_size(fmt: str, group: int | None = None) -> int:
    """Rows of K sharing one scale: int4's option (default 64), 32 for mxfp4, 128 for fp8, 0 (all) for int8."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt != "int4":
        if group is not None and group != _FIXED_GROUPS[fmt]:
            raise ValueError(f"a group size applies to int4 only; {fmt} has a fixed layout (jmoe.kernels.quantized)")
        return _FIXED_GROUPS[fmt]
    group = DEFAULT_INT4_GROUP if group is None else group
    if isinstance(group, bool) or not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"int4 group size must be an even whole number >= 2, found {group!r}")
    return group


def check_shape(fmt: str, group: int, k: int, name: str = "weight") -> None:
    """Raise ValueError unless a [.., K, N] weight can be stored in this format."""
    if fmt in _PACKED and k % 2:
        raise ValueError(f"{name}: {fmt} packs two rows per byte, so its input dimension must be even; found {k}")
    if fmt in ("int4", "mxfp4") and k % group:
        raise ValueError(f"{name}: {fmt} group size {group} must divide the input dimension {k}; choose a group "
                         f"size that divides {k}" + (" (expert_group_size)" if fmt == "int4" else ""))


@jax.tree_util.register_pytree_node_class
class QuantizedTensor:
    """A quantized [..., K, N] weight: `values` and `scales` are the pytree's leaves (every leading axis,
    e.g. the expert or slot axis, is shared by both), `fmt` and `group` its static structure."""

    def __init__(self, values, scales, fmt: str, group: int):
        self.values, self.scales, self.fmt, self.group = values, scales, fmt, group

    def tree_flatten(self):
        return (self.values, self.scales), (self.fmt, self.group)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        *lead, rows, n = self.values.shape
        return (*lead, rows * (2 if self.fmt in _PACKED else 1), n)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    def __getitem__(self, index) -> "QuantizedTensor":
        """Index the leading (expert / slot) axes, as on a plain weight array."""
        return QuantizedTensor(self.values[index], self.scales[index], self.fmt, self.group)

    def dequantize(self, dtype) -> jax.Array:
        return dequantize(self.fmt, self.group, self.values, self.scales, dtype)

    def __repr__(self):
        return f"QuantizedTensor({self.fmt}, group={self.group}, shape={self.shape})"


def is_quantized(weight) -> bool:
    return isinstance(weight, QuantizedTensor)


def materialize(weight, dtype) -> jax.Array:
    """A plain weight cast to `dtype`, a quantized one dequantized to it."""
    return weight.dequantize(dtype) if is_quantized(weight) else weight.astype(dtype)


def rows_of(weight, index, dtype) -> jax.Array:
    """weight[index] (leading axes) as `dtype`: the one way the XLA kernels read slots, so a dequantized
    copy never holds more than the slots it indexes."""
    return materialize(weight[index], dtype)


def contraction_extent(weight) -> int:
    """Rows a kernel loops over along K: K, or K/2 for two codes per byte."""
    return weight.values.shape[-2] if is_quantized(weight) and weight.fmt in _PACKED else weight.shape[-2]


def scale_rows(weight) -> int:
    """Rows of K that share one scale row (the whole K for int8, a block of 128 for fp8, 0 for a plain
    weight)."""
    if not is_quantized(weight):
        return 0
    return weight.shape[-2] if weight.fmt == "int8" else weight.group


# ---- decoding (jnp; also used inside Pallas kernels, so plain elementwise arithmetic only) ----

def decode_codes(fmt: str, values) -> jax.Array:
    """float32 values before scaling. Packed formats: [.., K/2, N] bytes -> (low, high) halves."""
    if fmt == "int8":
        return values.astype(jnp.float32)
    if fmt == "fp8":
        return jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn).astype(jnp.float32)
    low, high = values & 15, values >> 4
    if fmt == "int4":
        return (low.astype(jnp.float32) - 8, high.astype(jnp.float32) - 8)
    return decode_e2m1(low), decode_e2m1(high)


def decode_e2m1(code) -> jax.Array:
    """e2m1 code (0..15: sign, 2 exponent bits, 1 mantissa bit) -> float32, by arithmetic (no table, so it
    lowers inside a Triton kernel)."""
    code = code.astype(jnp.int32)
    exponent, mantissa = (code >> 1) & 3, (code & 1).astype(jnp.float32)
    power = (1 << exponent).astype(jnp.float32) * 0.5  # 2^(exponent - 1)
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * power)
    return jnp.where(code >= 8, -magnitude, magnitude)


def scale_values(fmt: str, scales) -> jax.Array:
    """float32 multipliers from stored scales (mxfp4's e8m0 bytes are powers of two)."""
    if fmt == "mxfp4":
        return jnp.exp2(scales.astype(jnp.float32) - 127)
    return scales.astype(jnp.float32)


def dequantize(fmt: str, group: int, values, scales, dtype) -> jax.Array:
    """[..., K, N] in `dtype`: decode * scale in float32, rounded once."""
    codes = decode_codes(fmt, values)
    if fmt in _PACKED:
        codes = jnp.concatenate(codes, axis=-2)
    k, n = codes.shape[-2:]
    scale = scale_values(fmt, scales)
    if fmt == "int8":
        w = codes * scale
    elif fmt == "fp8":
        expanded = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
        w = codes * expanded[..., :k, :n]
    else:
        lead = codes.shape[:-2]
        w = (codes.reshape(*lead, k // group, group, n) * scale[..., :, None, :]).reshape(*lead, k, n)
    return w.astype(dtype)


# ---- quantizing (NumPy, deterministic: same bytes every run) ----

def _safe_scale(amax: np.ndarray, top: float) -> np.ndarray:
    scale = (amax / np.float32(top)).astype(np.float32)
    return np.where(scale > 0, scale, np.float32(1))


def _pack_halves(codes: np.ndarray) -> np.ndarray:
    half = codes.shape[-2] // 2
    return (codes[..., :half, :] | (codes[..., half:, :] << 4)).astype(np.uint8)


def quantize(w: np.ndarray, fmt: str, group: int | None = None) -> QuantizedTensor:
    """NumPy W [..., K, N] (any float dtype) -> QuantizedTensor of NumPy arrays, per the table above."""
    group = group_size(fmt, group)
    w = np.asarray(w, np.float32)
    check_shape(fmt, group, w.shape[-2])
    if not np.isfinite(w).all():
        raise ValueError(f"cannot quantize a weight holding NaN or inf to {fmt}")
    k, n = w.shape[-2:]
    lead = w.shape[:-2]
    if fmt == "int8":
        scale = _safe_scale(np.abs(w).max(axis=-2, keepdims=True), 127)
        values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    elif fmt == "int4":
        grouped = w.reshape(*lead, k // group, group, n)
        scale = _safe_scale(np.abs(grouped).max(axis=-2), 7)
        codes = np.clip(np.rint(grouped / scale[..., :, None, :]), -7, 7).astype(np.int16) + 8
        values = _pack_halves(codes.reshape(*lead, k, n).astype(np.uint8))
    elif fmt == "fp8":
        kb, nb = math.ceil(k / FP8_BLOCK), math.ceil(n / FP8_BLOCK)
        padded = np.zeros((*lead, kb * FP8_BLOCK, nb * FP8_BLOCK), np.float32)
        padded[..., :k, :n] = w
        blocks = padded.reshape(*lead, kb, FP8_BLOCK, nb, FP8_BLOCK)
        scale = _safe_scale(np.abs(blocks).max(axis=(-3, -1)), 448)
        scaled = blocks / scale[..., :, None, :, None]
        values = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        values = values.reshape(padded.shape)[..., :k, :n]
    else:  # mxfp4
        grouped = w.reshape(*lead, k // group, group, n)
        amax = np.abs(grouped).max(axis=-2)
        exponent = np.floor(np.log2(np.where(amax > 0, amax, 1))).astype(np.int32) - 2  # e2m1's largest is 1.5 * 2^2
        exponent = np.where(amax > 0, np.clip(exponent, -127, 127), -127)
        scaled = grouped / np.exp2(exponent).astype(np.float32)[..., :, None, :]
        codes = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
        values = _pack_halves(codes.reshape(*lead, k, n))
        scale = (exponent + 127).astype(np.uint8)
    return QuantizedTensor(np.ascontiguousarray(values), np.ascontiguousarray(scale), fmt, group)


def quantized_shapes(fmt: str, group: int, shape: tuple[int, ...]) -> tuple[tuple, np.dtype, tuple, np.dtype]:
    """(values shape, values dtype, scales shape, scales dtype) of a [..., K, N] weight in this format,
    without quantizing anything (abstract models and plans)."""
    *lead, k, n = shape
    lead = tuple(lead)
    if fmt == "int8":
        return (*lead, k, n), np.dtype(np.int8), (*lead, 1, n), np.dtype(np.float32)
    if fmt == "int4":
        return (*lead, k // 2, n), np.dtype(np.uint8), (*lead, k // group, n), np.dtype(np.float32)
    if fmt == "fp8":
        return ((*lead, k, n), np.dtype(np.uint8),
                (*lead, math.ceil(k / FP8_BLOCK), math.ceil(n / FP8_BLOCK)), np.dtype(np.float32))
    return (*lead, k // 2, n), np.dtype(np.uint8), (*lead, k // group, n), np.dtype(np.uint8)
