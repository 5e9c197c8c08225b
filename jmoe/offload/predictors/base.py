"""The predictor interface and the step-order helpers every predictor shares (see jmoe.offload.predictors)."""

from __future__ import annotations

import numpy as np


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
