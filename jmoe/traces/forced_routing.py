"""Drive a jmoe Model's expert choice from a recorded routing trace (benchmarks and tests).

A random-weight model routes near uniformly, so its expert cache sees nothing like a real model's
traffic. A routing override (`Model.generate_detailed(..., routing_override=...)`) replaces the router's
choice inside the jitted step; this module turns a slice of a trace (expert ids [rows, L_moe, k], e.g.
GPT-OSS-20B's from bench/data) into that callable:

  * the prompt step (step 0, tokens [1, T], the prompt right-aligned after T - P padding columns)
    takes rows 0..P-1 for its P prompt tokens; padding columns get row 0 (any valid id: the model
    masks padded tokens out of the routing it reports);
  * decode step s (s >= 1, tokens [1, 1]) takes row P + s - 1.

Batch 1 only: the callable sees only the tokens' shape, so it cannot tell how several prompts of
different lengths were padded.

    routing = TraceRouting(rows, prompt_len=len(prompt), config=model.config)
    model.generate_detailed([prompt], routing.max_new_tokens, SamplingParams(), routing_override=routing)
"""

from __future__ import annotations

import numpy as np

from jmoe.traces.load import TraceError  # a slice that does not fit the model or the generation

__all__ = ["TraceRouting", "TraceError"]


class TraceRouting:
    """`forced_routing` callable: (step, tokens_shape) -> int32 [L_moe, 1, T, k] expert ids from a trace."""

    def __init__(self, rows: np.ndarray, prompt_len: int, config):
        rows = np.asarray(rows)
        expected = (config.num_moe_layers, config.num_experts_per_tok)
        if rows.ndim != 3 or rows.shape[1:] != expected:
            raise TraceError(f"trace rows: expected shape [rows, {expected[0]} MoE layers, top-{expected[1]}] "
                             f"for this model, found {list(rows.shape)}")
        if not np.issubdtype(rows.dtype, np.integer):
            raise TraceError(f"trace rows: expected integer expert ids, found dtype {rows.dtype}")
        if rows.size and (rows.min() < 0 or rows.max() >= config.num_experts):
            raise TraceError(f"trace rows: expected expert ids in [0, {config.num_experts}), found "
                             f"[{rows.min()}, {rows.max()}]")
        if not 1 <= prompt_len <= len(rows):
            raise TraceError(f"prompt_len must be in [1, {len(rows)}] (the slice has {len(rows)} rows), "
                             f"found {prompt_len}")
        # [rows, L, k] -> [L, rows, k]: the engine's layout, so a step is one slice.
        self._ids = np.ascontiguousarray(rows.astype(np.int32).transpose(1, 0, 2))
        self.prompt_len = prompt_len

    @property
    def max_new_tokens(self) -> int:
        """The most new tokens a generation can make from this slice (the last token needs no step)."""
        return self._ids.shape[1] - self.prompt_len + 1

    def __call__(self, step: int, tokens_shape: tuple[int, int]) -> np.ndarray:
        batch, length = tokens_shape
        if batch != 1:
            raise TraceError(f"TraceRouting drives batch 1 only, found a step with {batch} rows")
        if step == 0:
            if length < self.prompt_len:
                raise TraceError(f"prompt step has {length} token columns, fewer than prompt_len="
                                 f"{self.prompt_len}; pass the prompt's real length")
            pad = length - self.prompt_len
            ids = np.concatenate([np.repeat(self._ids[:, :1], pad, axis=1), self._ids[:, :self.prompt_len]], axis=1)
            return ids[:, None]
        if length != 1:
            raise TraceError(f"decode step {step}: expected 1 token column, found {length}")
        row = self.prompt_len + step - 1
        if row >= self._ids.shape[1]:
            raise TraceError(f"decode step {step} needs trace row {row}, the slice has {self._ids.shape[1]} rows; "
                             f"generate at most {self.max_new_tokens} new tokens or pass a longer slice")
        return self._ids[:, None, row:row + 1]
