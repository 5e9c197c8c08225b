"""Prefetch by routing history in the engine: the replay's recommended setting (`--prefetch best`: the
`lags` predictor with the settings below) copying experts ahead of the layers that will need them.

The predictor's score of an expert at MoE layer l of the coming token is a sum of evidence from earlier
steps. Between steps, `HistoryPrefetch` keeps each row's recent routing and computes the part known before
the token starts (`base`: prior, evidence from earlier tokens, recency; NumPy). Inside the step, as each
layer routes, the engine adds the evidence of this token's layers that ran before the predicted one
(`in_step_scores`) and `jmoe.offload.slots.prefetch_by_score` copies the experts the replay's rule takes (at
most `budget`, `copy_into_slots`: only those move) into the layer's cache. Several rows: an expert's score is its
best over the rows.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jmoe.errors import InputError
from jmoe.offload.predictors import MultiLagPredictor, make_predictor

# The replay's "best" setting (jmoe.traces.replay.PREFETCH_SETTINGS, tuned on GPT-OSS mmlu* routing:
# bench/results/replay_prefetch.md): predicted set size, score threshold, copies per layer and token,
# and the score a copy must gain over its victim. It was tuned with the lfru cache policy.
BEST = {"count": 8, "min_score": 0.0, "budget": 4, "min_gain": 2.0}


def routing_trace_array(trace, argument: str) -> np.ndarray:
    """`trace` itself, or the array in the .npy file it names (`argument`: the parameter, for the error)."""
    if not isinstance(trace, (str, Path)):
        return trace
    path = Path(trace)
    if path.suffix != ".npy" or not path.is_file():
        raise InputError(f"{argument}: expected a .npy routing trace [tokens, MoE layers, k], found {str(path)!r}; "
                         f"record one from the model's routing (Model.logits_and_routing)")
    return np.load(path)


def best_predictor(trace, num_experts: int) -> MultiLagPredictor:
    """The `best` setting's predictor fitted on a routing trace of the model: an int array (or a .npy file)
    [tokens, MoE layers, k], tokens in decode order."""
    trace = routing_trace_array(trace, "prefetch_trace")
    try:
        return make_predictor("lags", count=BEST["count"], min_score=BEST["min_score"]).fit(trace, num_experts)
    except ValueError as e:
        raise InputError(f"prefetch_trace: {e}") from None


class HistoryPrefetch:
    """Between steps: the recent routing of each row and the scores known before the next token."""

    def __init__(self, predictor: MultiLagPredictor, num_moe_layers: int, num_experts: int):
        layers, experts = predictor.log_prior.shape
        if (layers, experts) != (num_moe_layers, num_experts):
            raise InputError(f"prefetch predictor is for {layers} MoE layers x {experts} experts, the model has "
                             f"{num_moe_layers} x {num_experts}: fit it on this model's routing")
        self.predictor = predictor
        self.lags = predictor.within_token_lags()
        self.within = jnp.asarray(predictor.within_token_evidence())  # [D, L, E + 1, E]: EngineState.history_evidence
        self.history: np.ndarray | None = None  # int [rows, H, L, k]

    def observe(self, routing: np.ndarray) -> None:
        """routing int [L, B, T, k] of a finished step (-1 = a padding token). A step of several tokens per
        row starts new sequences; a decode step appends one token to each row."""
        rows = np.asarray(routing).transpose(1, 2, 0, 3)  # [B, T, L, k]
        context = self.predictor.context
        if rows.shape[1] > 1 or self.history is None or self.history.shape[0] != rows.shape[0]:
            self.history = rows[:, -context:]
        else:
            self.history = np.concatenate([self.history, rows], axis=1)[:, -context:]

    def base(self) -> np.ndarray:
        """float32 [L, E]: per MoE layer, the best over the rows of the next token's score from the steps
        before that token."""
        if self.history is None:
            num_layers, num_experts = self.predictor.log_prior.shape
            top_k = 1
            return self.predictor.next_token_base(np.zeros((0, num_layers, top_k), np.int64))
        return np.max([self.predictor.next_token_base(rows) for rows in self.history], axis=0)

    def in_step_scores(self, base, layer, token_ids, within):
        """Inside the step: float32 [E], the scores for MoE layer `layer` from `base` [E] plus the evidence
        of this token's layers `layer - d` (token_ids int [L, N, k]: each MoE layer's ids so far, -1 = none) in
        `within` (the step's copy of `self.within`). `layer` is an int, or an int32 array (a chained step's block,
        whose layers' places are its arguments: a lag past the first layer then adds nothing, as the int's skips
        it)."""
        num_experts = base.shape[0]
        rows = base
        known = isinstance(layer, int)
        for index, lag in enumerate(self.lags):
            if known and layer - lag < 0:
                continue
            ids = token_ids[layer - lag if known else jnp.maximum(layer - lag, 0)]
            evidence = within[index, layer][jnp.where(ids < 0, num_experts, ids)].sum(axis=-2)
            rows = rows + (evidence if known else jnp.where(layer >= lag, evidence, 0.0))
        return rows.max(axis=0) if rows.ndim == 2 else rows
