"""Miss modes "host" and "direct" in a decode step: an offloaded layer's cached experts run from their slots, every
other needed expert where its weights lie, so the device makes no demand copies (the manager's plan admits this
step's misses as the next step starts, `jmoe.offload.engine`). "host" computes them on the host; "direct" has a GPU's
expert kernel read them in pinned host memory over the link."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmoe.errors import InputError
from jmoe.kernels import ExpertKernel, ExpertWeights
from jmoe.kernels.dispatch import moe_ffn_from_sources
from jmoe.kernels.pallas_grouped import GPU_MIN_BLOCK, gpu_shapes_supported
from jmoe.kernels.target import platform_dependent
from jmoe.offload.slots import LayerSlots, StepCounts, count_hits, experts_on_host_where, needed_experts, slot_ids_of


def compute_misses_where_they_lie(slots: LayerSlots, host: ExpertWeights, x, ids, weights, *, kernel: ExpertKernel,
                                  miss_mode: str) -> tuple[jax.Array, StepCounts]:
    """Miss modes "host" and "direct", decode path: cached experts run on the device from their slots; every
    other needed expert runs where its weights lie (`experts_on_host_where`, `experts_read_in_place`), so the
    device makes no demand copies for them. This step's misses are admitted into the cache by the manager's plan for
    the next step (OffloadEngine), copied as that step starts. Returns (float32 y [T, d], counts)."""
    num_experts = slots.slot_of_expert.shape[0]
    hits = count_hits(slots.slot_of_expert, ids)
    missing = needed_experts(ids, num_experts) & (slots.slot_of_expert < 0)
    cached = (slot_ids_of(slots.slot_of_expert, ids), slots.buffers) if slots.expert_in_slot.shape[0] else None
    if miss_mode == "direct":
        y = experts_read_in_place(missing, x, ids, weights, host, kernel, cached)
    else:
        y = experts_on_host_where(missing, x, ids, weights, host, kernel) + cached_experts(x, weights, cached, kernel)
    counts = StepCounts(hits, jnp.sum(ids >= 0, dtype=jnp.int32) - hits, jnp.int32(0), jnp.int32(0))
    return y, counts


def cached_experts(x, weights, cached, kernel: ExpertKernel) -> jax.Array:
    """float32 [T, d]: the choices `cached` names ((slot ids [T, k], the cache slots), or None: none) from their
    slots."""
    if cached is None:
        return jnp.zeros(x.shape, jnp.float32)
    slot_ids, buffers = cached
    return kernel(x, slot_ids, weights, buffers, out_dtype=jnp.float32)


def experts_read_in_place(missing, x, ids, weights, host: ExpertWeights, kernel: ExpertKernel,
                          cached=None) -> jax.Array:
    """float32 [T, d]: the contribution of the experts marked in `missing` (bool [E]), miss mode "direct", and of the
    choices `cached` names (`cached_experts`). On a GPU the Pallas grouped GEMM (Triton) is handed the pinned-host
    expert arrays as they are (XLA copies nothing first: tests/test_gpu_step.py) and reads the missed experts' weight
    tiles over the host link: only their bytes, with no demand copies and no host round trip; a one-row step reads
    every choice, cached or not, in the same two kernels (`moe_ffn_from_sources`). Elsewhere host and device memory
    are one RAM, and the host computes the missed experts (`experts_on_host_where`)."""
    def elsewhere(missing, x, ids, weights, host, cached):
        on_host = experts_on_host_where(missing, x, ids, weights, host, kernel)
        return on_host + cached_experts(x, weights, cached, kernel)

    return platform_dependent(missing, x, ids, weights, host, cached,
                              cuda=functools.partial(missed_experts_by_kernel, kernel=kernel), default=elsewhere)


def missed_experts_by_kernel(missing, x, ids, weights, experts: ExpertWeights, cached, kernel: ExpertKernel
                             ) -> jax.Array:
    """float32 [T, d]: the Pallas grouped GEMM over `experts` (all E of them, wherever they are) for the choices
    of an expert marked in `missing` (bool [E]), the other choices reading nothing; plus `cached_experts`, in the
    same kernels for a one-row step."""
    experts = experts.stacked()
    if not gpu_shapes_supported(experts.w_gate_up, experts.w_down):  # XLA's kernels cannot read host memory
        leaves = jax.tree.leaves(experts)
        raise InputError(f'miss_mode="direct" computes missed experts with the Triton expert kernel, whose blocks '
                         f'need the hidden size and the expert width divisible by {GPU_MIN_BLOCK} and which cannot '
                         f'address a layer of 2-4 GiB of one-byte codes; found hidden size {x.shape[-1]}, expert width '
                         f'{experts.w_down.shape[1]}, arrays of shapes {[leaf.shape for leaf in leaves]} '
                         f'{[str(leaf.dtype) for leaf in leaves]}. Use miss_mode="host" or "fetch" for this model')
    missed = jnp.where(missing[jnp.maximum(ids, 0)] & (ids >= 0), ids, -1)
    if cached is not None and x.shape[0] == 1:
        return moe_ffn_from_sources(x, weights, [cached, (missed, experts)], activation=kernel.activation)
    return (ExpertKernel("pallas", kernel.activation)(x, missed, weights, experts, out_dtype=jnp.float32)
            + cached_experts(x, weights, cached, kernel))