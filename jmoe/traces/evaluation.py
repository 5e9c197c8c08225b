"""Offline evaluation of expert predictors: their predicted set at every step of a trace, and
precision and recall against the experts the trace then used.

The predictors themselves live in :mod:`jmoe.offload.predictors` (the runtime engine uses
them); so does :func:`~jmoe.offload.predictors.top_experts`, which turns any score array into
predicted sets.
"""

from __future__ import annotations

import numpy as np

from jmoe.offload.predictors import Predictor


def predicted_sets(predictor: Predictor, expert_ids: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """bool [T, L, E]: the predictor's set for every step of a trace, computed in chunks."""
    parts = []
    for start in range(0, len(expert_ids), chunk):
        history = expert_ids[max(0, start - predictor.context) : start]
        parts.append(predictor.predict(expert_ids[start : start + chunk], history))
    return np.concatenate(parts)


def precision_recall(predicted: np.ndarray, expert_ids: np.ndarray) -> dict:
    """How well predicted sets ``[T, L, E]`` (bool) match the experts used ``[T, L, k]``.

    precision = correct / predicted, recall = correct / used, per layer and overall
    (pooled over all steps, not averaged over steps). A layer that predicted nothing has
    precision 0.
    """
    predicted = np.asarray(predicted, dtype=bool)
    expert_ids = np.asarray(expert_ids, dtype=np.int64)
    if predicted.shape[:2] != expert_ids.shape[:2]:
        raise ValueError(
            f"precision_recall: predicted sets {list(predicted.shape)} and trace "
            f"{list(expert_ids.shape)} differ in [tokens, layers]"
        )
    correct = np.take_along_axis(predicted, expert_ids, axis=2).sum(axis=(0, 2))
    guessed = predicted.sum(axis=(0, 2))
    used = expert_ids.shape[0] * expert_ids.shape[2]
    return {
        "precision": float(correct.sum() / max(guessed.sum(), 1)),
        "recall": float(correct.sum() / (used * expert_ids.shape[1])),
        "predicted_per_step": float(guessed.sum() / (expert_ids.shape[0] * expert_ids.shape[1])),
        "layer_precision": (correct / np.maximum(guessed, 1)).tolist(),
        "layer_recall": (correct / used).tolist(),
    }
