"""Where expert weights are read from during a step: the interface, and the all-resident engine.

An engine has a pytree `state` that every jitted step takes (donated) and returns, a `bind` used while
tracing that returns the ExpertCompute for that state plus a `finish` giving the updated state, and
`after_step`, called between steps with the host copy of that state and of the step's routing.
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

    def bind(self, state, num_tokens: int) -> tuple[ExpertCompute | None, Callable[[], tuple]]:
        return None, lambda: state

    def readback(self, state) -> tuple:
        return ()

    def after_step(self, state, tables_host, routing: np.ndarray) -> None:
        pass

    def stats(self) -> list[dict]:
        return []
