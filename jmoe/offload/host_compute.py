"""Expert FFNs computed on the host, where offloaded expert weights live (miss mode "host").

Inside a jitted step, `compute_on(compute_type="device_host")` runs a sub-computation on the host CPU. Only the
activations, routing and the list of experts cross to the host and the result comes back: the expert
weights stay in pinned host memory and are read there. JAX types every array with its memory space
and refuses operations that mix host and device arrays, so everything the host computation builds is
derived from its host inputs (or explicitly placed in host memory).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmoe.kernels import ExpertWeights
from jmoe.kernels.activations import get_activation
from jmoe.kernels.bias import bias_rows
from jmoe.kernels.quantized import materialize
from jmoe.memory import computed_on_host, to_device, to_host


def _experts_on_host(x, ids, weights, experts, count, host: ExpertWeights, *, activation: str):
    act = get_activation(activation)
    f = host.w_down.shape[1]

    def expert_weight(weight, expert):
        # One expert of a plain or quantized weight (every leaf), in x's dtype: dequantized here, on the host.
        one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, expert, 0, keepdims=False), weight)
        return materialize(one, x.dtype)

    def add_expert(j, acc):
        expert = experts[j]
        # Each token's routing weight for this expert (0 when it did not choose it). A product, not jnp.where:
        # where would broadcast its scalar 0 into a device-typed array.
        token_weight = jnp.sum(weights.astype(jnp.float32) * (ids == expert), axis=1, keepdims=True)
        gate_up = jnp.dot(x, expert_weight(host.w_gate_up, expert), preferred_element_type=jnp.float32)
        gate_up = gate_up + bias_rows(host.b_gate_up, expert)
        h = act(gate_up[:, :f], gate_up[:, f:]).astype(x.dtype)
        y = jnp.dot(h, expert_weight(host.w_down, expert), preferred_element_type=jnp.float32)
        y = y + bias_rows(host.b_down, expert)
        return acc + token_weight * y

    return jax.lax.fori_loop(0, count, add_expert, to_host(jnp.zeros(x.shape, jnp.float32)))


def experts_on_host(x, ids, weights, experts, count, host: ExpertWeights, *, activation: str):
    """float32 [T, d] on the device: sum over `experts[:count]` (int32, distinct) of every token's routing
    weight for that expert times the expert's FFN, computed on the host from `host` (the layer's experts
    in pinned host memory). ids int32 [T, k] (-1 = none), weights [T, k].

    Each listed expert's weights are read once and applied to all T rows, so this suits decode-sized
    steps; big prefill steps stream experts to the device instead (jmoe.offload.slots).
    """
    x, ids, weights, experts, count = to_host((x, ids, weights, experts, count))
    return to_device(_on_host(activation)(x, ids, weights, experts, count, host))


@functools.cache
def _on_host(activation: str):
    # One per activation, made once: see computed_on_host.
    return computed_on_host(functools.partial(_experts_on_host, activation=activation))
