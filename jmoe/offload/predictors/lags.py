"""The `lags` predictor: co-occurrence evidence from several earlier steps (see jmoe.offload.predictors)."""

from __future__ import annotations

import numpy as np

from jmoe.offload.predictors.base import (_check_ids, _tokens_for_lag, steps_back, _lag_counts, _evidence_tables, _evidence_sum, _recent_use, Predictor)


class MultiLagPredictor(Predictor):
    """Weighted naive Bayes over several earlier steps, plus ``mix``'s recency term.

    One co-occurrence table per lag (as ``crosslayer``'s, fitted by ``fit``): the steps 1, 2,
    3 ... before the step (``step_weights``) and the same layer at the previous token
    (``token_weight``; that is ``L`` steps back). Then

        score(b) = log P(b) + sum over lags d of weight_d x sum over the k experts a of the step
                   d steps before of [log P(b | a) - log P(b)]
                   + recency_weight x recent use of b by the same layer (as ``mix``)

    Weights below 1 temper naive Bayes's double counting of overlapping evidence. A step a
    lag reaches before the trace (no ``history``) adds nothing. Defaults tuned on the GPT-OSS
    mmlu* sequences only (``bench/results/replay_prefetch.md``).
    """

    name = "lags"
    DEFAULT_STEP_WEIGHTS = (0.7, 0.5, 0.3)
    DEFAULT_TOKEN_WEIGHT = 0.3
    DEFAULT_RECENCY_WEIGHT = 0.5
    DEFAULT_RECENCY_DECAY = 0.95

    def __init__(self, count: int = 8, min_score: float = -np.inf, smoothing: float = 1.0,
                 step_weights: tuple[float, ...] = DEFAULT_STEP_WEIGHTS,
                 token_weight: float = DEFAULT_TOKEN_WEIGHT,
                 recency_weight: float = DEFAULT_RECENCY_WEIGHT,
                 recency_decay: float = DEFAULT_RECENCY_DECAY, recency_context: int = 32):
        super().__init__(count, min_score)
        weights = tuple(float(w) for w in step_weights) + (float(token_weight),)
        if (not smoothing > 0 or min(weights) < 0 or not 0.0 <= recency_decay <= 1.0
                or int(recency_context) < 1):
            raise ValueError(
                f"lags predictor: expected smoothing > 0, weights >= 0, 0 <= recency_decay <= 1 "
                f"and recency_context >= 1, found smoothing={smoothing}, step_weights="
                f"{tuple(step_weights)}, token_weight={token_weight}, recency_decay="
                f"{recency_decay}, recency_context={recency_context}"
            )
        self.smoothing = float(smoothing)
        self.step_weights = weights[:-1]
        self.token_weight = weights[-1]
        self.recency_weight = float(recency_weight)
        self.recency_decay = float(recency_decay)
        self.recency_context = int(recency_context)
        self.context = self.recency_context
        self.tables: dict[int, np.ndarray] = {}  # lag in steps -> evidence [L, E + 1, E]

    def _lag_weights(self, num_layers: int) -> dict[int, float]:
        """Weight per lag in steps; the token lag adds to a step lag when L <= len(step_weights)."""
        weights = dict(enumerate(self.step_weights, start=1))
        weights[num_layers] = weights.get(num_layers, 0.0) + self.token_weight
        return {lag: w for lag, w in weights.items() if w > 0}  # zero weights need no table

    def fit(self, expert_ids, num_experts):
        super().fit(expert_ids, num_experts)
        expert_ids = _check_ids(expert_ids, num_experts)
        num_layers = expert_ids.shape[1]
        counts = {lag: _lag_counts(expert_ids, num_experts, lag)
                  for lag in {1, *self._lag_weights(num_layers)}}
        self.log_prior = _evidence_tables(counts[1], self.smoothing)[0]
        self.tables = {lag: _evidence_tables(c, self.smoothing)[1] for lag, c in counts.items()}
        self._set_context(num_layers)
        return self

    def copy_tables_from(self, fitted: "MultiLagPredictor") -> "MultiLagPredictor":
        """Use the tables of a fitted ``lags`` predictor (same smoothing) with this one's weights,
        without refitting: for trying many weights on one fit. Returns self."""
        needed = set(self._lag_weights(fitted.log_prior.shape[0]))
        if fitted.smoothing != self.smoothing or not needed <= set(fitted.tables):
            raise ValueError(
                f"lags predictor: expected a fitted predictor with smoothing {self.smoothing} and "
                f"tables for lags {sorted(needed)}, found smoothing {fitted.smoothing} and lags "
                f"{sorted(fitted.tables)}: fit one with every weight you need > 0"
            )
        self.num_experts, self.log_prior, self.tables = (fitted.num_experts, fitted.log_prior,
                                                         fitted.tables)
        self._set_context(fitted.log_prior.shape[0])
        return self

    def _set_context(self, num_layers: int) -> None:
        longest = max(self._lag_weights(num_layers), default=1)
        self.context = max(self.recency_context, _tokens_for_lag(longest, num_layers))

    def scores(self, expert_ids, history=None):
        expert_ids = self._ready(expert_ids)
        if expert_ids.shape[1] != self.log_prior.shape[0]:
            raise ValueError(
                f"lags predictor was fitted on {self.log_prior.shape[0]} layers, the trace has "
                f"{expert_ids.shape[1]}"
            )
        total = np.broadcast_to(self.log_prior, expert_ids.shape[:2] + (self.num_experts,)).copy()
        for lag, weight in self._lag_weights(expert_ids.shape[1]).items():
            total += np.float32(weight) * _evidence_sum(
                self.tables[lag], steps_back(expert_ids, history, lag))
        recent = _recent_use(expert_ids, history, self.num_experts, self.recency_context,
                             self.recency_decay)
        return total + np.float32(self.recency_weight) * recent

    # ---- the engine's split: between steps (NumPy) and inside the step (jmoe.offload.engine) ----------
    def within_token_lags(self) -> tuple[int, ...]:
        """The lags (in steps) whose earlier step can be a layer of the same token: step lags below L."""
        num_layers = self.log_prior.shape[0]
        return tuple(lag for lag in sorted(self._lag_weights(num_layers)) if lag < num_layers)

    def within_token_evidence(self) -> np.ndarray:
        """float32 [D, L, E + 1, E]: weight x evidence table of each lag of `within_token_lags()` (row E:
        no such step). Inside a step, layer l's score adds, for each such lag d <= l, the rows of the k
        experts layer l - d chose."""
        num_layers = self.log_prior.shape[0]
        weights = self._lag_weights(num_layers)
        lags = self.within_token_lags()
        if not lags:
            return np.zeros((0, num_layers, self.num_experts + 1, self.num_experts), np.float32)
        return np.stack([np.float32(weights[lag]) * self.tables[lag] for lag in lags])

    def next_token_base(self, history: np.ndarray) -> np.ndarray:
        """float32 [L, E]: the scores of the token after `history` ([H, L, k]) from everything but that
        token's own layers: `scores(next[None], history)[0]` equals this plus, per layer l, the
        within-token evidence of the layers l - d (d in `within_token_lags()`, d <= l) of `next`."""
        num_layers = self.log_prior.shape[0]
        top_k = np.asarray(history).shape[2]
        unknown = np.zeros((1, num_layers, top_k), np.int64)  # the next token: not known yet
        layer = np.arange(num_layers)[None, :, None]
        total = self.log_prior.copy()
        for lag, weight in self._lag_weights(num_layers).items():
            before = steps_back(unknown, history, lag)
            before = np.where(layer >= lag, -1, before)  # steps inside the next token: added in the step
            total += np.float32(weight) * _evidence_sum(self.tables[lag], before)[0]
        recent = _recent_use(unknown, history, self.num_experts, self.recency_context, self.recency_decay)[0]
        return (total + np.float32(self.recency_weight) * recent).astype(np.float32)

    def __repr__(self) -> str:
        return (f"MultiLagPredictor(count={self.count}, min_score={self.min_score}, "
                f"smoothing={self.smoothing}, step_weights={self.step_weights}, "
                f"token_weight={self.token_weight}, recency_weight={self.recency_weight}, "
                f"recency_decay={self.recency_decay}, recency_context={self.recency_context})")
