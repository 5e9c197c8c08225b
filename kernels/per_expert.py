"""Experts held one per array on a CPU, at no memory cost: views of a stacked array's buffer.

XLA:CPU copies every slice of a stacked [S, ...] array before a dot reads it, so at batch-1 decode each
(token, expert) pair first copies the expert's weights, then reads the copy: on the 215M compare checkpoint's
shapes the expert FFNs of one token (8 layers) take 16.5 ms stacked against 7.2 ms on one array per expert
(bench/results/cpu_expert_reads_per_expert.md). On a CPU, `jax.device_put` of a NumPy view of an array's buffer makes
an array without copying, so each expert can be its own array while the stacked one stays the parameter that
placement, checkpoints and slots see. `pairs` and `xla_tiled` then choose the expert's FFN with lax.switch
(jmoe.kernels.xla._unless_empty), whose every branch reads its own arrays in place.

An offloaded layer's experts in pinned host memory get views too: on a CPU that memory is the same RAM, and the
prompt step reads them in place (jmoe.offload.slots.experts_in_place). Slots, and the copies that fill them, stay
stacked (jmoe.offload.slots.empty_slots and device_copy leave the views out).
"""

from __future__ import annotations

import jax
import numpy as np

from jmoe.kernels.dispatch import ExpertWeights
from jmoe.kernels.float_bits import FloatBits, is_float16
from jmoe.memory import DEVICE, PINNED_HOST

# Experts smaller than this are read stacked: below it the copy stays in the cache and the views gain little,
# while every branch costs compile time (8 layers of 16 experts, decode: 1.0 s -> 4.7 s). Measured at batch 1,
# 8 layers of 16 experts, float32, ms per token stacked vs per expert (bench/results/cpu_expert_reads_per_expert.md):
# 1.5 MiB experts 2.75 vs 2.61, 3 MiB 10.36 vs 4.48, 3.4 MiB 12.35 vs 5.19, 6 MiB 16.27 vs 6.77.
MIN_EXPERT_BYTES = 2 * 2**20
# More experts than this per layer are read stacked: compile time grows with layers x experts.
MAX_EXPERTS = 64


def per_expert_views(experts: ExpertWeights) -> tuple[ExpertWeights, ...] | None:
    """The experts one per array ([1, ...] leaves sharing the stacked leaves' memory, in the same memory kind), or
    None where that is not free or not worth it: leaves not in one CPU device's device or pinned-host memory,
    experts too small or too many, or a view that JAX would have to copy (a buffer not aligned for zero-copy)."""
    stacked = experts.stacked()
    leaves = _cpu_leaves(stacked)
    if leaves is None:
        return None
    count = stacked.num_experts
    if count == 0 or count > MAX_EXPERTS or sum(a.nbytes for a in leaves) // count < MIN_EXPERT_BYTES:
        return None
    hosts = [np.asarray(a) for a in leaves]  # the arrays' own buffers on a CPU, no copy
    treedef = jax.tree.structure(stacked)
    rows = []
    for e in range(count):
        row = [_view(host[e:e + 1], a.sharding) for host, a in zip(hosts, leaves)]
        if any(view is None for view in row):
            return None
        rows.append(jax.tree.unflatten(treedef, row))
    return tuple(rows)


def float_bits_views(experts: ExpertWeights) -> ExpertWeights | None:
    """The stacked experts with every 16-bit float leaf as FloatBits of a uint16 view of its buffer (same memory
    kind, no copy; jmoe.kernels.float_bits says why), or None where there is none to make: no such leaf, leaves not
    in one CPU device's device or pinned-host memory, or a view that JAX would have to copy."""
    stacked = experts.stacked()
    leaves = _cpu_leaves(stacked)
    if leaves is None or not any(is_float16(a.dtype) for a in leaves):
        return None
    out = []
    for a in leaves:
        if not is_float16(a.dtype):
            out.append(a)
            continue
        bits = _view(np.asarray(a).view(np.uint16), a.sharding)  # the array's own buffer on a CPU, no copy
        if bits is None:
            return None
        out.append(FloatBits(bits, a.dtype))
    return jax.tree.unflatten(jax.tree.structure(stacked), out)


def _cpu_leaves(stacked: ExpertWeights) -> list[jax.Array] | None:
    """The leaves of `stacked`, or None unless every one is a JAX array in one CPU device's device or pinned-host
    memory (where a NumPy view of its buffer is the array itself)."""
    leaves = jax.tree.leaves(stacked)
    return leaves if all(isinstance(a, jax.Array) and _in_one_cpu_memory(a) for a in leaves) else None


def _view(host: np.ndarray, sharding) -> jax.Array | None:
    """`host` as a JAX array with `sharding` sharing its buffer, or None where JAX would copy it (a buffer not
    aligned for zero-copy): a view that costs its size again is not worth holding."""
    view = jax.device_put(host, sharding)
    return view if view.unsafe_buffer_pointer() == host.ctypes.data else None


def _in_one_cpu_memory(array: jax.Array) -> bool:
    devices = array.devices()
    return (len(devices) == 1 and next(iter(devices)).platform == "cpu" and not array.is_deleted()
            and array.sharding.memory_kind in (None, DEVICE, PINNED_HOST))
