"""Where expert weights are read from during a step: the interface, and the all-resident engine.

An engine has a pytree `state` that every jitted step takes (donated) and returns. While tracing,
`prepare_params` may move parameters to the device and `bind` returns the ExpertCompute for that
state plus a `finish` giving the updated state. Between steps, `after_step` gets the new state, the
host copy of `readback(state)` and the step's routing (read together in one device-to-host read).
The offload engine (jmoe.offload.engine) implements the same methods.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jmoe.model import ExpertCompute


class ResidentEngine:
    """Every expert on the device: the model's own stacked weights, no state, nothing to manage."""

    def __init__(self, config, backend: str = "auto"):
        self.config = config
        self.backend = backend
        self.state = ()

    def attach(self, model) -> None:
        pass

    def reset(self, policy) -> None:
        pass  # nothing is cached, so no policy applies

    def prepare_params(self, params):
        return params

    def bind(self, state, model, num_tokens: int) -> tuple[ExpertCompute | None, Callable[[], tuple]]:
        return None, lambda: state

    def readback(self, state) -> tuple:
        return ()

    def after_step(self, state, tables_host, routing: np.ndarray) -> None:
        self.state = state

    def stats(self) -> list[dict]:
        return []
