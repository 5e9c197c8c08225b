"""Where expert weights are read from during a step: the interface, and the all-resident engine.

An engine has a pytree `state` that every jitted step takes (donated) and returns. While tracing,
`prepare_params` may move parameters to the device, `layer_hook` may return a callback the model runs
at the start of every decoder layer (to fetch weights ahead), and `bind` returns the ExpertCompute for
that state plus a `finish` giving the updated state. Between steps, `after_step` gets the new state, the
host copy of `readback(state)` and the step's routing (read together in one device-to-host read).
The offload engine (jmoe.offload.engine) implements the same methods.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jmoe.model import ExpertCompute
from jmoe.offload.layer_groups import layer_fetch_hook
from jmoe.offload.placement import HOST, Placement


class ResidentEngine:
    """Every expert on the device, read from the model's own stacked weights: no state, nothing to manage.
    Parameters the placement keeps in pinned host memory (not experts) are copied in during each step: at
    its start, or, for layer groups, when the layer `prefetch_step` before theirs starts."""

    def __init__(self, config, backend: str = "auto", placement: Placement | None = None):
        self.config = config
        self.backend = backend
        self.placement = placement
        self.state = ()
        fetched_ahead = {key for keys in placement.fetched_keys.values() for key in keys} if placement else set()
        self.host_param_keys = frozenset(
            key for key, kind in (placement.memory_kind.items() if placement else ())
            if kind == HOST and "experts" not in key.split(".") and key not in fetched_ahead)

    def attach(self, model) -> None:
        pass

    def reset(self, policy) -> None:
        pass  # nothing is cached, so no policy applies

    def prepare_params(self, params):
        """Parameters offloaded by pattern (not experts, not layer groups) are copied in at every step."""
        if not self.host_param_keys:
            return params

        def to_device(path, leaf):
            # Parameter paths are dict keys followed by the Variable's `.value` attribute.
            key = ".".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))
            return jax.device_put(leaf, jax.memory.Space.Device) if key in self.host_param_keys else leaf

        return jax.tree_util.tree_map_with_path(to_device, params)

    def layer_hook(self, model):
        """The model's before-layer callback that fetches grouped layers' weights ahead (None without groups)."""
        if self.placement is None or not self.placement.fetched_keys:
            return None
        return layer_fetch_hook(self.placement.layer_groups, self.placement.fetched_keys, model)

    def bind(self, state, model, num_tokens: int) -> tuple[ExpertCompute | None, Callable[[], tuple]]:
        return None, lambda: state

    def readback(self, state) -> tuple:
        return ()

    def after_step(self, state, tables_host, routing: np.ndarray) -> None:
        self.state = state

    def stats(self) -> list[dict]:
        return []
