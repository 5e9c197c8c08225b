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


def _check_ids(expert_ids: np.ndarray, num_experts: int, what: str = "expert_ids") -> np.ndarray:
    expert_ids = np.asarray(expert_ids)
    if expert_ids.ndim != 3 or not np.issubdtype(expert_ids.dtype, np.integer):
        raise ValueError(
            f"{what}: expected integer expert ids shaped [tokens, layers, k], found "
            f"{expert_ids.dtype} shape {list(expert_ids.shape)}"
        )
    if expert_ids.size and (expert_ids.min() < 0 or expert_ids.max() >= num_experts):
        raise ValueError(
            f"{what}: expected expert ids in [0, {num_experts}), found range "
            f"[{expert_ids.min()}, {expert_ids.max()}]"
        )
    return expert_ids.astype(np.int64)


def _check_history(expert_ids: np.ndarray, history: np.ndarray | None, context: int) -> np.ndarray:
    """int64 [context, L, k]: the last ``context`` tokens before the first row (-1 = unknown)."""
    rows = np.full((context,) + expert_ids.shape[1:], -1, dtype=np.int64)
    if history is None or context == 0:
        return rows
    history = np.asarray(history, dtype=np.int64)
    if history.ndim != 3 or history.shape[1:] != expert_ids.shape[1:]:
        raise ValueError(
            f"history: expected earlier tokens shaped [tokens, layers, k] with [layers, k] = "
            f"{list(expert_ids.shape[1:])}, found {list(history.shape)}"
        )
    kept = history[len(history) - min(context, len(history)):]
    rows[context - len(kept):] = kept
    return rows


def _previous_rows(expert_ids: np.ndarray, history: np.ndarray | None) -> np.ndarray:
    """int64 [T, L, k]: the routing of the token before each row (-1 = unknown)."""
    return np.concatenate([_check_history(expert_ids, history, 1), expert_ids[:-1]])


def step_before(expert_ids: np.ndarray, history: np.ndarray | None = None) -> np.ndarray:
    """int64 [T, L, k]: the experts of the step that runs just before each step ``(t, l)``.

    That is ``ids[t, l - 1]`` for ``l > 0`` and ``ids[t - 1, L - 1]`` for ``l = 0`` (from
    ``history`` for ``t = 0``; -1 where there is no such step).
    """
    expert_ids = np.asarray(expert_ids, dtype=np.int64)
    before = np.empty_like(expert_ids)
    before[:, 1:] = expert_ids[:, :-1]
    before[:, 0] = _previous_rows(expert_ids, history)[:, -1]
    return before


def _tokens_for_lag(lag: int, num_layers: int) -> int:
    """Tokens of history that reach ``lag`` steps back from layer 0 of the first row."""
    return -(-lag // num_layers)


def steps_back(expert_ids: np.ndarray, history: np.ndarray | None, lag: int) -> np.ndarray:
    """int64 [T, L, k]: the experts of the step ``lag`` steps before each step (``lag = 1``:
    :func:`step_before`; ``lag = L``: the same layer at the previous token). Steps before the
    first row come from ``history``; -1 where there is no such step."""
    expert_ids = np.asarray(expert_ids, dtype=np.int64)
    num_tokens, num_layers, top_k = expert_ids.shape
    if lag < 1:
        raise ValueError(f"steps_back: expected lag >= 1 step, found {lag}")
    earlier = _check_history(expert_ids, history, _tokens_for_lag(lag, num_layers))
    steps = np.concatenate([earlier, expert_ids]).reshape(-1, top_k)  # one row per step
    start = len(earlier) * num_layers - lag
    return steps[start : start + num_tokens * num_layers].reshape(expert_ids.shape)


def _lag_counts(expert_ids: np.ndarray, num_experts: int, lag: int,
                chunk: int = 1 << 18) -> dict[str, np.ndarray]:
    """Co-occurrence counts between each step and the step ``lag`` steps before it, per layer
    of the later step (``pair``, ``before``, ``used``, ``steps``: see CrossLayerPredictor). The
    first ``lag`` steps of the trace have no such step and are not counted."""
    num_layers, top_k = expert_ids.shape[1:]
    steps = expert_ids.reshape(-1, top_k)
    layer = np.arange(len(steps)) % num_layers
    pair = np.zeros(num_layers * num_experts * num_experts, dtype=np.int64)
    before = np.zeros(num_layers * num_experts, dtype=np.int64)
    used = np.zeros(num_layers * num_experts, dtype=np.int64)
    for start in range(lag, len(steps), chunk):  # chunks of steps bound the k x k pair array
        stop = min(start + chunk, len(steps))
        row = layer[start:stop, None] * num_experts
        a, b = row + steps[start - lag : stop - lag], row + steps[start:stop]
        pair += np.bincount((a[:, :, None] * num_experts + steps[start:stop, None, :]).ravel(),
                            minlength=pair.size)
        before += np.bincount(a.ravel(), minlength=before.size)
        used += np.bincount(b.ravel(), minlength=used.size)
    return {
        "pair": pair.reshape(num_layers, num_experts, num_experts),
        "before": before.reshape(num_layers, num_experts),
        "used": used.reshape(num_layers, num_experts),
        "steps": np.bincount(layer[lag:], minlength=num_layers).astype(np.int64),
    }


def _evidence_tables(counts: dict[str, np.ndarray], smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """(log P(b) [L, E], evidence [L, E + 1, E]) from co-occurrence ``counts``:
    ``evidence[l, a, b] = log P(b | a) - log P(b)``, and a row of zeros at ``a = E`` for
    "no such step"."""
    prior = (counts["used"] + 1.0) / (counts["steps"][:, None] + 2.0)  # [L, E]
    conditional = (counts["pair"] + smoothing * prior[:, None, :]) / (
        counts["before"][:, :, None] + smoothing
    )
    evidence = np.log(conditional) - np.log(prior)[:, None, :]
    pad = np.zeros((evidence.shape[0], 1, evidence.shape[2]))
    return (np.log(prior).astype(np.float32),
            np.concatenate([evidence, pad], axis=1).astype(np.float32))


def _evidence_sum(evidence: np.ndarray, experts_before: np.ndarray) -> np.ndarray:
    """float32 [T, L, E]: per step, the evidence [L, E + 1, E] summed over the k experts of an
    earlier step ``experts_before`` [T, L, k] (-1 = no such step, adds nothing)."""
    num_experts = evidence.shape[-1]
    layer = np.arange(experts_before.shape[1])[None, :, None]
    return evidence[layer, np.where(experts_before < 0, num_experts, experts_before)].sum(axis=2)


def _recent_use(expert_ids: np.ndarray, history: np.ndarray | None, num_experts: int,
                context: int, decay: float) -> np.ndarray:
    """float32 [T, L, E]: ``sum over j = 1 .. context of decay ** (j - 1) * [layer used e at
    token t - j]``, earlier tokens from ``history``."""
    rows = np.concatenate([_check_history(expert_ids, history, context), expert_ids])
    used = _one_hot(rows, num_experts).astype(np.float32)  # [context + T, L, E]
    recent = np.zeros((len(expert_ids),) + used.shape[1:], dtype=np.float32)
    for lag in range(1, context + 1):  # the token t - lag sits at row context + t - lag
        recent += np.float32(decay ** (lag - 1)) * used[context - lag : context - lag + len(expert_ids)]
    return recent


def _one_hot(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """bool [T, L, E] from ids [T, L, k]; ids of -1 set nothing."""
    mask = np.zeros(expert_ids.shape[:2] + (num_experts + 1,), dtype=bool)
    np.put_along_axis(mask, np.where(expert_ids < 0, num_experts, expert_ids), True, axis=2)
    return mask[..., :num_experts]


def top_experts(scores: np.ndarray, count: int, min_score: float = -np.inf) -> np.ndarray:
    """bool like ``scores`` [..., E]: per row, the ``count`` experts of highest score among those
    with score >= ``min_score`` (ties: lower expert id first)."""
    scores = np.asarray(scores)
    if count < 0:
        raise ValueError(f"top_experts: expected count >= 0, found {count}")
    order = np.argsort(-scores, axis=-1, kind="stable")  # stable: equal scores keep id order
    chosen = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(chosen, order[..., :count], True, axis=-1)
    return chosen & (scores >= min_score)


class Predictor:
    """Base class. Subclasses set ``name`` and implement :meth:`scores` (and :meth:`fit` if they
    learn anything). ``count`` and ``min_score`` bound the predicted set of each step."""

    name = "base"
    context = 0  # tokens of history that scores() reads

    def __init__(self, count: int, min_score: float = -np.inf):
        if int(count) < 0:
            raise ValueError(f"{self.name} predictor: expected count >= 0, found {count}")
        self.count = int(count)
        self.min_score = float(min_score)
        self.num_experts: int | None = None

    def fit(self, expert_ids: np.ndarray, num_experts: int) -> "Predictor":
        _check_ids(expert_ids, num_experts)
        self.num_experts = int(num_experts)
        return self

    def _ready(self, expert_ids: np.ndarray) -> np.ndarray:
        if self.num_experts is None:
            raise ValueError(
                f"{self.name} predictor is not fitted: call fit(trace, num_experts) "
                f"(or load_predictor(path)) first"
            )
        return _check_ids(expert_ids, self.num_experts)

    def scores(self, expert_ids: np.ndarray, history: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} must implement scores()")

    def predict(self, expert_ids: np.ndarray, history: np.ndarray | None = None) -> np.ndarray:
        return top_experts(self.scores(expert_ids, history), self.count, self.min_score)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(count={self.count}, min_score={self.min_score})"


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

    def __repr__(self) -> str:
        return (f"MultiLagPredictor(count={self.count}, min_score={self.min_score}, "
                f"smoothing={self.smoothing}, step_weights={self.step_weights}, "
                f"token_weight={self.token_weight}, recency_weight={self.recency_weight}, "
                f"recency_decay={self.recency_decay}, recency_context={self.recency_context})")


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
