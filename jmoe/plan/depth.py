"""Deep models planned from two shallow compiles.

XLA:GPU's compile of jmoe's decode and prefill steps grows by seconds per decoder layer (layers are unrolled),
so a 94-layer model took a quarter of an hour to plan on two cores. A model's layers repeat: after a prefix (a
DeepSeek's dense layers) every layer looks like the one a period earlier (the same block kind, attention window
and placement). With `extrapolate_layers` such a model is compiled with the prefix and 2, then 3, periods of its
body (plus the partial period it ends with), and the numbers the plan reads from a program are extrapolated
linearly to the model's periods: argument, output and alias sizes exactly (each period adds the same
parameters, cache and slots), loop and kernel counts as compiled whole, flops within 0.6%, bytes accessed within
1% except where prefill streams experts (Qwen3-30B: 35% under; they enter only the speed estimate's slow end):
bench/results/plan_depth.md. Temporaries are not: XLA schedules a short program differently (see
programs.TEMPORARIES), so an extrapolated plan leaves them out and says so. A reduction is used only when the
shallow model's own placement matches the deep one's, layer for layer.
"""

from __future__ import annotations

import dataclasses

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.plan.hlo import ControlFlow

REDUCE_FROM_LAYERS = 16  # shallower models are compiled whole
PERIODS = (2, 3)  # body periods of the two compiled programs
MAX_PERIOD = 8


@dataclasses.dataclass(frozen=True)
class Reduction:
    """Compile the first `layers[0]` and `layers[1]` decoder layers; the model has `periods[2]` body periods."""

    layers: tuple[int, int]
    periods: tuple[int, int, int]

    def extrapolate(self, small: float, large: float) -> float:
        """A quantity measured at the two compiled depths, at the model's."""
        (a, b, full) = self.periods
        return small + (large - small) * (full - a) / (b - a)


def layer_signatures(cfg: ModelConfig, placement) -> list[tuple]:
    """What makes each decoder layer's compiled code and memory what it is: block kind, attention window, and
    where each of its parameters lives (with the layer index taken out of the names), its cache, its group."""
    moe_position = {layer: i for i, layer in enumerate(cfg.moe_layer_indices)}
    caches = dict(zip(placement.offloaded_layers, placement.caches))
    signatures = []
    for layer in range(cfg.num_layers):
        prefix = f"layers.{layer}."
        params = tuple(sorted((key[len(prefix):], kind) for key, kind in placement.memory_kind.items()
                              if key.startswith(prefix)))
        fetched = tuple(sorted(key[len(prefix):] for key in placement.fetched_keys.get(layer, ())))
        position = moe_position.get(layer)
        grouped = None if placement.layer_groups is None else placement.layer_groups.offloaded(layer)
        signatures.append((cfg.moe_layers[layer], cfg.sliding_windows[layer], params, fetched,
                           None if position is None else caches.get(position), grouped))
    return signatures


def global_facts(placement) -> tuple:
    """What every layer shares: scratch slots, the bytes of one expert and of a layer's fetch buffer."""
    return placement.scratch, placement.expert_bytes, placement.fetch_buffer_bytes


def find_reduction(signatures: list[tuple]) -> Reduction | None:
    """The shortest prefix + period after which every layer repeats the one a period before, if compiling
    fewer layers then saves anything."""
    total = len(signatures)
    if total < REDUCE_FROM_LAYERS:
        return None
    for span in range(1, total):  # prefix + period, shortest first
        for period in range(1, min(span, MAX_PERIOD) + 1):
            prefix = span - period
            if all(signatures[i] == signatures[i - period] for i in range(prefix + period, total)):
                periods, tail = divmod(total - prefix, period)
                if periods <= PERIODS[1]:
                    return None
                layers = tuple(prefix + m * period + tail for m in PERIODS)
                return Reduction(layers, (*PERIODS, periods))
    return None


def reduced_config(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The model's first `layers` decoder layers (everything else as it is)."""
    return dataclasses.replace(cfg, num_layers=layers, moe_layers=cfg.moe_layers[:layers],
                               sliding_windows=cfg.sliding_windows[:layers])


def plan_reduction(cfg: ModelConfig, placement_of) -> Reduction | None:
    """The reduction to compile with, checked: each shallow model's placement (`placement_of(config)`) gives its
    layers the deep model's first layers' signatures and the same shared facts; None = compile whole."""
    full = placement_of(cfg)
    signatures = layer_signatures(cfg, full)
    reduction = find_reduction(signatures)
    if reduction is None:
        return None
    for layers in reduction.layers:
        shallow = reduced_config(cfg, layers)
        try:
            placement = placement_of(shallow)
        except InputError:  # options sized for the deep model (a cache per layer, say)
            return None
        if layer_signatures(shallow, placement) != signatures[:layers] or global_facts(placement) != global_facts(full):
            return None
    return reduction


def extrapolated_flow(reduction: Reduction, small: ControlFlow, large: ControlFlow) -> ControlFlow:
    return ControlFlow(**{field: round(reduction.extrapolate(getattr(small, field), getattr(large, field)))
                          for field in small.as_dict()})
