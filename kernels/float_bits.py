"""16-bit float expert arrays carried as their uint16 bits on a CPU.

XLA:CPU computes slices and updates of bfloat16 (and float16) arrays in float32 (its float normalization), and it
moves the conversion of a loop-invariant operand out of the loop: a decode step that copies experts into scratch
slots by a loop converted each layer's whole host array to a float32 temporary, and every iteration converted the
whole scratch buffer there and back (a 2-layer model of 32 experts of 0.6 MB: 94 MB of temporaries against
2.7 MB; the disk-tier bench model: 2.8-7.5 GB). The same arrays as uint16 are sliced, copied and updated as they
are, and a kernel turns only the slot it reads back into floats. fp8 experts are kept as bytes for the same
reason (jmoe.kernels.quantized).

`FloatBits` holds the bits and the float dtype they stand for; it answers `shape`, `ndim`, `dtype` (the float
one), indexing and `astype` as the float array would, so the kernels read it through `rows_of` / `materialize`
like a plain weight. It is a pytree whose one leaf is the uint16 array: slots, copies, rows and the disk tier's
reads move it leaf by leaf unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT16_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@jax.tree_util.register_pytree_node_class
class FloatBits:
    """A 16-bit float array [..] held as uint16 bits of the same shape (see the module docstring)."""

    def __init__(self, bits, dtype):
        self.bits, self.dtype = bits, jnp.dtype(dtype)

    def tree_flatten(self):
        return (self.bits,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        return cls(children[0], dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return len(self.bits.shape)

    def __getitem__(self, index) -> "FloatBits":
        return FloatBits(self.bits[index], self.dtype)

    def astype(self, dtype) -> jax.Array:
        """The float values (as `dtype`)."""
        return jax.lax.bitcast_convert_type(self.bits, self.dtype).astype(dtype)

    def __repr__(self):
        return f"FloatBits({self.dtype}, shape={self.shape})"


def is_float_bits(weight) -> bool:
    return isinstance(weight, FloatBits)


def is_float16(dtype) -> bool:
    """Whether `dtype` is a 16-bit float (bfloat16 or float16), which XLA:CPU moves through float32."""
    return jnp.dtype(dtype) in FLOAT16_DTYPES


def as_float_bits(array: np.ndarray) -> FloatBits:
    """A NumPy array of a 16-bit float dtype as FloatBits of a view of its buffer (no copy)."""
    return FloatBits(array.view(np.uint16), array.dtype)


def plain(weight):
    """A FloatBits as the float array it stands for (a whole-array conversion: for backends that take refs of
    plain arrays, Pallas and Triton); anything else unchanged."""
    return weight.astype(weight.dtype) if is_float_bits(weight) else weight


def float_leaves(tree):
    """The leaves of `tree` with each FloatBits as one leaf (what a kernel sees: float shapes and dtypes)."""
    return jax.tree.leaves(tree, is_leaf=is_float_bits)
