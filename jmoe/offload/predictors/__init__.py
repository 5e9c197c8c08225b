"""Expert predictors: which experts the next MoE layer to run will need, from routing history.

A prefetcher copies experts into a layer's slots *before* the layer asks for them; it needs a
guess of what the layer will route to. The predictors here guess from routing history only
(expert ids already chosen), so they work on recorded traces as well as in the engine.

Order of steps. Decoding runs token ``t`` through layers ``0 .. L-1``, then token ``t + 1``.
The step before ``(t, l)`` is ``(t, l - 1)``, and for layer 0 it is ``(t - 1, L - 1)``. A
prediction for step ``(t, l)`` may use every expert id chosen before it: ``ids[t, :l]`` and
``ids[:t]``, plus ``history``: the tokens before the first row, in order (``[H, L, k]``; a
predictor reads only its last ``predictor.context`` rows). It never looks at ``ids[t, l]`` or
later.

Interface (vectorised over tokens and layers; no Python loop over layers):

* ``predictor.fit(expert_ids, num_experts)``: learn from a trace ``[T, L, k]`` (one stream of
  decode tokens in order); returns the predictor. Predictors without parameters only record
  the shape.
* ``predictor.scores(expert_ids, history=None)``: float32 ``[T, L, E]``; ``scores[t, l, e]``
  says how strongly expert ``e`` is expected at step ``(t, l)`` (higher = more likely; the
  scale is the predictor's own, see each class).
* ``predictor.predict(expert_ids, history=None)``: bool ``[T, L, E]``, the predicted set of
  every step: at most ``count`` experts, those of highest score with score >= ``min_score``
  (ties: lower expert id first). :func:`top_experts` does this for any score array.
* ``jmoe.traces.evaluation.precision_recall`` scores predicted sets against what a trace then
  used (offline evaluation lives in :mod:`jmoe.traces`).

Predictors (``make_predictor(name)``; :func:`predictor_names` lists them):

* ``previous``: the experts the same layer used at the previous token.
* ``frequency``: the experts a layer uses most often (marginal counts from ``fit``).
* ``crosslayer``: co-occurrence between consecutive steps, ``P(e at step (t, l) | experts at
  the step before)``, combined over the k experts of the step before as a naive-Bayes
  log-score. Its table is learned by ``fit``; :meth:`CrossLayerPredictor.save` /
  :func:`load_predictor` keep it in an ``.npz`` with its provenance.
* ``mix``: ``crosslayer``'s log-score plus ``recency_weight`` times how much the same layer
  used the expert over the last ``context`` tokens, each older token weighing ``recency_decay``
  times less (``recency_decay = 0`` counts the previous token only).
* ``lags``: like ``mix``, with co-occurrence evidence from several earlier steps (1, 2, 3 steps
  before, and the same layer at the previous token), each weighted (weights < 1 temper naive
  Bayes's double counting). Its tables are fitted on a trace by ``fit`` (no saved table).

What a router-based predictor would add: apply layer ``l + 1``'s router to the hidden state
leaving layer ``l`` (the residual stream changes little between layers), which needs the
model's weights and activations, not a trace of ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmoe.offload.predictors.base import Predictor, step_before, steps_back, top_experts
from jmoe.offload.predictors.lags import MultiLagPredictor
from jmoe.offload.predictors.tables import (CrossLayerPredictor, FrequencyPredictor, MixPredictor,
                                            PreviousTokenPredictor)

__all__ = [
    "Predictor",
    "PreviousTokenPredictor",
    "FrequencyPredictor",
    "CrossLayerPredictor",
    "MixPredictor",
    "MultiLagPredictor",
    "top_experts",
    "step_before",
    "steps_back",
    "make_predictor",
    "load_predictor",
    "predictor_names",
]


_REGISTRY = {
    "previous": PreviousTokenPredictor,
    "frequency": FrequencyPredictor,
    "crosslayer": CrossLayerPredictor,
    "mix": MixPredictor,
    "lags": MultiLagPredictor,
}


def predictor_names() -> list[str]:
    return list(_REGISTRY)


def make_predictor(name: str, **kwargs) -> Predictor:
    """A fresh (unfitted) predictor by name; ``kwargs`` go to its constructor."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(
            f"unknown predictor {name!r}; known predictors: {', '.join(predictor_names())}"
        )
    return factory(**kwargs)


def load_predictor(path: str | Path, name: str = "crosslayer", **kwargs) -> CrossLayerPredictor:
    """A ``crosslayer`` (or ``mix``) predictor with the counts saved at ``path``; ``kwargs`` go to
    the constructor. ``predictor.provenance`` holds the strings saved with the table."""
    if name not in ("crosslayer", "mix"):
        raise ValueError(f"load_predictor: only crosslayer and mix use a table, found {name!r}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"predictor table {path} not found; fit one and save() it first")
    predictor = make_predictor(name, **kwargs)
    with np.load(path) as data:
        if str(data["kind"]) != CrossLayerPredictor.name:
            raise ValueError(f"{path}: expected a crosslayer table, found kind {data['kind']}")
        predictor._set_counts(data["pair"], data["before"], data["used"], data["steps"])
        predictor.provenance = {key[len("provenance_"):]: str(data[key])
                                for key in data.files if key.startswith("provenance_")}
    return predictor
