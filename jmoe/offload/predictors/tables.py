"""History predictors with simple tables: previous token, frequency, cross-layer co-occurrence and its mix
with recency (see jmoe.offload.predictors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmoe.offload.predictors.base import (_check_ids, _previous_rows, step_before, _lag_counts, _evidence_tables, _evidence_sum, _recent_use, _one_hot, Predictor)


class PreviousTokenPredictor(Predictor):
    """Score 1 for the experts the same layer used at the previous token, 0 otherwise.

    Default ``min_score = 0.5``: the predicted set is exactly those k experts (none at the
    first token without ``history``).
    """

    name = "previous"
    context = 1

    def __init__(self, count: int = 8, min_score: float = 0.5):
        super().__init__(count, min_score)

    def scores(self, expert_ids, history=None):
        expert_ids = self._ready(expert_ids)
        return _one_hot(_previous_rows(expert_ids, history), self.num_experts).astype(np.float32)


class FrequencyPredictor(Predictor):
    """Score = log of how often the layer used the expert in the fitted trace (a fixed prior)."""

    name = "frequency"

    def __init__(self, count: int = 4, min_score: float = -np.inf):
        super().__init__(count, min_score)
        self.log_prior: np.ndarray | None = None

    def fit(self, expert_ids, num_experts):
        super().fit(expert_ids, num_experts)
        expert_ids = _check_ids(expert_ids, num_experts)
        counts = _one_hot(expert_ids, num_experts).sum(axis=0)  # [L, E]
        # Add-one smoothing of the Bernoulli "layer uses e at a step".
        self.log_prior = np.log((counts + 1.0) / (len(expert_ids) + 2.0)).astype(np.float32)
        return self

    def scores(self, expert_ids, history=None):
        expert_ids = self._ready(expert_ids)
        return np.broadcast_to(self.log_prior, expert_ids.shape[:2] + (self.num_experts,)).copy()


class CrossLayerPredictor(Predictor):
    """Naive-Bayes co-occurrence between a step and the step before it.

    ``fit`` counts, per layer ``l``: ``pair[l, a, b]`` = steps ``(t, l)`` that used ``b`` while
    the step before (:func:`step_before`) used ``a``; ``before[l, a]`` = steps whose step before
    used ``a``; ``used[l, b]`` = steps that used ``b``; ``steps[l]``. Then

        P(b) = (used + 1) / (steps + 2)
        P(b | a) = (pair + smoothing * P(b)) / (before + smoothing)
        score(b) = log P(b) + sum over the k experts a of the step before of
                   [log P(b | a) - log P(b)]

    a log-score (not calibrated: the k experts are not independent evidence). Without a step
    before (first token, no ``history``) the score is ``log P(b)``.
    """

    name = "crosslayer"
    context = 1

    def __init__(self, count: int = 8, min_score: float = -np.inf, smoothing: float = 1.0):
        super().__init__(count, min_score)
        if not smoothing > 0:
            raise ValueError(f"crosslayer predictor: expected smoothing > 0, found {smoothing}")
        self.smoothing = float(smoothing)
        self.counts: dict[str, np.ndarray] | None = None
        self.provenance: dict[str, str] = {}

    def fit(self, expert_ids, num_experts):
        super().fit(expert_ids, num_experts)
        self._set_counts(**_lag_counts(_check_ids(expert_ids, num_experts), num_experts, lag=1))
        return self

    def _set_counts(self, pair, before, used, steps) -> None:
        self.counts = {
            "pair": np.asarray(pair, dtype=np.int64),
            "before": np.asarray(before, dtype=np.int64),
            "used": np.asarray(used, dtype=np.int64),
            "steps": np.asarray(steps, dtype=np.int64),
        }
        self.num_experts = self.counts["pair"].shape[-1]
        self.log_prior, self.evidence = _evidence_tables(self.counts, self.smoothing)

    def scores(self, expert_ids, history=None):
        expert_ids = self._ready(expert_ids)
        if expert_ids.shape[1] != self.evidence.shape[0]:
            raise ValueError(
                f"crosslayer predictor was fitted on {self.evidence.shape[0]} layers, "
                f"the trace has {expert_ids.shape[1]}"
            )
        return self.log_prior + _evidence_sum(self.evidence, step_before(expert_ids, history))

    def save(self, path: str | Path, **provenance: str) -> Path:
        """Write the fitted counts and ``provenance`` (strings) to ``path`` (.npz, no pickle)."""
        if self.counts is None:
            raise ValueError("crosslayer predictor is not fitted: nothing to save")
        path = Path(path)
        meta = {f"provenance_{key}": np.array(str(value)) for key, value in provenance.items()}
        np.savez_compressed(path, kind=np.array(self.name), **self.counts, **meta)
        return path

    def __repr__(self) -> str:
        return (f"CrossLayerPredictor(count={self.count}, min_score={self.min_score}, "
                f"smoothing={self.smoothing})")


class MixPredictor(CrossLayerPredictor):
    """``crosslayer``'s log-score + ``recency_weight`` x recent use of the expert by the same
    layer: ``sum over j = 1 .. context of recency_decay ** (j - 1) * [layer used e at token
    t - j]``. The recency term makes up for what the cross-layer table cannot see: experts a
    layer keeps choosing over a stretch of tokens. The window is cut at ``context`` tokens so
    that a score depends on the same rows however a trace is cut into chunks. Defaults tuned on
    the GPT-OSS mmlu* sequences only (``bench/results/replay_prefetch.md``)."""

    name = "mix"
    DEFAULT_RECENCY_WEIGHT = 0.5
    DEFAULT_RECENCY_DECAY = 0.95

    def __init__(self, count: int = 8, min_score: float = -np.inf, smoothing: float = 1.0,
                 recency_weight: float = DEFAULT_RECENCY_WEIGHT,
                 recency_decay: float = DEFAULT_RECENCY_DECAY, context: int = 32):
        super().__init__(count, min_score, smoothing)
        if not 0.0 <= recency_decay <= 1.0 or int(context) < 1:
            raise ValueError(
                f"mix predictor: expected 0 <= recency_decay <= 1 and context >= 1, found "
                f"recency_decay={recency_decay}, context={context}"
            )
        self.recency_weight = float(recency_weight)
        self.recency_decay = float(recency_decay)
        self.context = int(context)

    def scores(self, expert_ids, history=None):
        cross = super().scores(expert_ids, history)
        recent = _recent_use(np.asarray(expert_ids, dtype=np.int64), history, self.num_experts,
                             self.context, self.recency_decay)
        return cross + np.float32(self.recency_weight) * recent

    def __repr__(self) -> str:
        return (f"MixPredictor(count={self.count}, min_score={self.min_score}, "
                f"smoothing={self.smoothing}, recency_weight={self.recency_weight}, "
                f"recency_decay={self.recency_decay}, context={self.context})")
