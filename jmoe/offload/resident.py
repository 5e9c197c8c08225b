"""Where expert weights are read from during a step: the interface, and the all-resident engine.

An engine owns the model's placement and has a pytree `state` that every jitted step takes (donated) and
returns. While tracing, `prepare_params` may move parameters to the device, `layer_hook` may return a
callback the model runs at the start of every decoder layer (to fetch weights ahead), and `bind` gets the
MoE layers' weights and routers (`MoELayerView`s) and returns the ExpertCompute for that state plus a
`finish` giving the updated state. Whoever runs a step makes the state it returned the engine's `state` (the next
step may be dispatched on it at once); `after_step` then gets the host copy of `readback(state)` (which the step
returns apart, since the state is donated to the next one) and the step's routing, read together in one
device-to-host read, and writes what its manager decides into the latest state. `abstract_state`
gives the state's shapes without allocating it, so the steps can be compiled for another device. `spmd`
wraps the step's forward: as is here; the expert-parallel engine (jmoe.offload.expert_parallel) runs it on
every device of its mesh, each device's engine computing its own experts' share (`owned`, `combine`).
A deep model's chained step (jmoe.decode.chain) binds each block of layers on its own: `block_span` says which part
of the state a block takes and its static layout, `block_state` / `with_block_state` take that part out and put it
back, `bind_block` binds it, and `first_carry` starts what the blocks hand each other (the offload engine's
prefetch needs the layers before a block's). The offload engine (jmoe.offload.engine) implements the same methods.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.kernels import ExpertKernel
from jmoe.memory import PINNED_HOST, to_device
from jmoe.model import ExpertCompute, MoELayerView
from jmoe.model.params import param_key
from jmoe.offload.layer_groups import layer_fetch_hook
from jmoe.offload.placement import Placement


def fetched(tree, keys, prefix: tuple = ()):
    """Inside a jitted program: `tree` (parameters at path `prefix`) with the leaves whose dotted name is in `keys`
    copied to the device."""
    if not keys:
        return tree

    def fetch(path, leaf):
        # Parameter paths are dict keys followed by the Variable's `.value` attribute.
        key = param_key(prefix + tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey)))
        return to_device(leaf) if key in keys else leaf

    return jax.tree_util.tree_map_with_path(fetch, tree)


class ResidentEngine:
    """Every expert on the device, read from the model's own stacked weights: no state, nothing to manage.
    Parameters the placement keeps in pinned host memory (not experts) are copied in during each step: at
    its start, or, for layer groups, when the layer `prefetch_step` before theirs starts."""

    # The mesh the experts are split over (ExpertParallelEngine's; None: one device), and, set by it on each
    # device's engine, the mesh axis: that engine's config.num_experts is then one device's share.
    mesh = None
    expert_axis: str | None = None
    # Whether a step may be dispatched before the last one's after_step (its manager's tables then a step old).
    runs_ahead = True

    def __init__(self, config, placement: Placement, backend: str = "auto"):
        self.config = config
        self.backend = backend
        self.kernel = ExpertKernel(backend, config.expert_activation)
        self.placement = placement
        self.state = ()
        fetched_ahead = {key for keys in placement.fetched_keys.values() for key in keys}
        self.host_param_keys = frozenset(
            key for key, kind in placement.memory_kind.items()
            if kind == PINNED_HOST and "experts" not in key.split(".") and key not in fetched_ahead)

    def block_span(self, moe_start: int, moe_stop: int):
        """(What `block_state` takes of the state, the static layout `bind_block` takes) for MoE layers [moe_start,
        moe_stop): nothing here (the offload engine's: their slots' positions and BlockLayout)."""
        return None, None

    def first_carry(self, x):
        """What a chained step's first block's bind_block takes as its carry, made from the embedded tokens x
        [B, T, d] (the offload engine's router prefetch from no layer; none here)."""
        return None

    def block_state(self, state, span):
        """What a block's program takes of the engine state: all of it (none) here."""
        return state

    @staticmethod
    def with_block_state(state, span, block):
        """The state once a block's program returned `block` (block_state's result, updated)."""
        return block

    def attach(self, layers: list[MoELayerView]) -> None:
        """Called once with the loaded model's MoE layers (the offload engine keeps their host arrays)."""

    def reset(self, policy) -> None:
        pass  # nothing is cached, so no policy applies

    def varying_shapes(self) -> tuple:
        """The shapes in the state that may change over the engine's life (a compiled step is looked up by them
        too): none here."""
        return ()

    def abstract_state(self, layers: list[MoELayerView]) -> tuple:
        """The state's shapes for abstract `layers`, for compiling the steps ahead of time: none here."""
        return self.state

    def prepare_params(self, params):
        """Parameters offloaded by pattern (not experts, not layer groups) are copied in at every step."""
        return fetched(params, self.host_param_keys)

    def block_host_params(self, start: int, end: int) -> tuple[frozenset, ...]:
        """Per decoder layer of [start, end), the names within it of its parameters offloaded by pattern, which a
        chained step's block copies in as it starts (alike blocks name the same ones)."""
        return tuple(frozenset(key.removeprefix(f"layers.{i}.") for key in self.host_param_keys
                               if key.startswith(f"layers.{i}.")) for i in range(start, end))

    def block_fetched_params(self, start: int, end: int) -> tuple[tuple[str, ...], ...]:
        """Per decoder layer of [start, end), the names within it of its weights a layer group fetches ahead."""
        return tuple(tuple(key.removeprefix(f"layers.{i}.") for key in self.placement.fetched_keys.get(i, ()))
                     for i in range(start, end))

    def layer_hook(self, model):
        """The model's before-layer callback that fetches grouped layers' weights ahead (None without groups)."""
        by_layer = self.block_fetched_params(0, self.config.num_layers)
        return layer_fetch_hook(self.placement.layer_groups, by_layer, list(model.layers)) if any(by_layer) else None

    def resident_experts(self, layer: MoELayerView, x, ids, weights) -> jax.Array:
        """The MoE FFN of x [N, d] over experts held whole on the device (ids this engine's, `owned`):
        float32 [N, d], for `combine`."""
        return self.kernel(x, ids, weights, layer.experts, out_dtype=jnp.float32)

    def owned(self, ids: jax.Array) -> jax.Array:
        """The router's expert ids [N, k] as this engine's: under an expert axis, the device at position d owns
        experts [d*E_d, (d+1)*E_d) (E_d = config.num_experts) and every other expert becomes -1, none here."""
        if self.expert_axis is None:
            return ids
        local = ids - jax.lax.axis_index(self.expert_axis) * self.config.num_experts
        return jnp.where((local >= 0) & (local < self.config.num_experts), local, -1)

    def own_scores(self, scores: jax.Array) -> jax.Array:
        """Per-expert scores [..., E] of every expert -> [..., E_d] of the experts this engine owns."""
        if self.expert_axis is None:
            return scores
        first = jax.lax.axis_index(self.expert_axis) * self.config.num_experts
        return jax.lax.dynamic_slice_in_dim(scores, first, self.config.num_experts, axis=-1)

    def combine(self, y: jax.Array, x: jax.Array) -> jax.Array:
        """A MoE layer's routed output from this engine's float32 partial output `y`: added up over the expert
        axis (one all-reduce of activations), then rounded once to x's dtype, as one device would."""
        if self.expert_axis is not None:
            y = jax.lax.psum(y, self.expert_axis)
        return y.astype(x.dtype)

    def spmd(self, fn: Callable, params) -> Callable:
        """`fn(params, state, inputs)` as the step runs it: here as is; the expert-parallel engine runs it on
        every device of its mesh (jmoe.offload.expert_parallel)."""
        return fn

    def bind(self, state, layers: list[MoELayerView],
             tokens_shape: tuple[int, int]) -> tuple[ExpertCompute, Callable[[], tuple]]:
        def compute(moe_index, x, ids, weights):
            return self.combine(self.resident_experts(layers[moe_index], x, self.owned(ids), weights), x)

        return compute, lambda: state

    def bind_block(self, state, layers: list[MoELayerView], tokens_shape: tuple[int, int], layout, carry):
        """bind for a block of a chained step (`layers`: its MoE layers, `layout` its block_span's): finish()
        gives (the state, what the next block's binding takes: `carry` as it came, None here)."""
        compute, finish = ResidentEngine.bind(self, state, layers, tokens_shape)
        return compute, lambda: (finish(), carry)

    def readback(self, state) -> tuple:
        return ()

    def after_step(self, tables_host, routing: np.ndarray) -> None:
        """Nothing to manage."""

    def stats(self) -> list[dict]:
        return []
