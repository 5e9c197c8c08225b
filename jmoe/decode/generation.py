"""The generation loop: pad a batch of prompts, prefill, then decode one jitted step at a time.

Between steps Python does one device-to-host read (the sampled tokens, the routing ids and the expert
engine's small tables together), hands the routing to the expert engine, checks stop conditions and
streams tokens to the caller, while the device already runs the next step (dispatched on the tokens it sampled).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.arguments import is_whole_number, whole_number
from jmoe.config import ModelConfig
from jmoe.decode.sampling import SamplingParams
from jmoe.errors import InputError
from jmoe.model import empty_kv_cache

# Called after every step with the tokens generated so far for each row.
TokenCallback = Callable[[list[list[int]]], None]
# (step, tokens shape (B, T)) -> int [L_moe, B, T, k]: expert ids replacing the routers' choice at that step
# (step 0 is the prompt), e.g. jmoe.traces.forced_routing.TraceRouting driving a benchmark from a trace.
RoutingOverride = Callable[[int, tuple[int, int]], np.ndarray]


def bucket_length(n: int, minimum: int = 16) -> int:
    """Round a length up so that few distinct shapes get compiled: powers of two, then multiples of 512."""
    if n <= 512:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // 512) * 512


def bucket_batch(n: int) -> int:
    """Round a batch size up to a power of two, so that few distinct shapes get compiled."""
    return 1 << (n - 1).bit_length()


def check_token_ids(cfg: ModelConfig, rows: Sequence[Sequence[int]], what: str) -> None:
    if not rows:
        raise InputError(f"{what}: expected at least one prompt, found none")
    for r, row in enumerate(rows):
        if len(row) == 0:
            raise InputError(f"{what}: prompt {r} is empty; give at least one token")
        if len(row) > cfg.max_position_embeddings:
            raise InputError(f"{what}: prompt {r} has {len(row)} tokens, more than the model's "
                             f"max_position_embeddings ({cfg.max_position_embeddings}); shorten it")
        bad = [t for t in row if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise InputError(f"{what}: prompt {r} contains token id {bad[0]} outside the vocabulary "
                             f"[0, {cfg.vocab_size})")


def checked_length_and_seed(max_new_tokens, seed) -> tuple[int, int]:
    """max_new_tokens (>= 1) and seed (0 <= seed < 2**32) as ints, or an InputError saying what to change."""
    max_new_tokens = whole_number("max_new_tokens", max_new_tokens, 1, "tokens to generate per prompt")
    seed = whole_number("seed", seed, 0, "the sampling seed")
    if seed >= 2**32:  # JAX keeps the low 32 bits of a larger seed: two seeds would give one stream
        raise InputError(f"seed must be below 2**32, found {seed}; use a smaller seed")
    return max_new_tokens, seed


def as_rows(token_ids) -> list[list[int]]:
    """Accept one prompt (list of ints / 1-D array) or a batch (list of lists / 2-D array)."""
    if isinstance(token_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(token_ids)
        if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"token ids: expected an integer array of shape [T] or [B, T], found "
                             f"{arr.dtype} {arr.shape}")
        return [list(map(int, r)) for r in (arr[None] if arr.ndim == 1 else arr)]
    expected = "token ids: expected a list of ints (one prompt) or a list of such lists (a batch)"
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InputError(f"{expected}, found {type(token_ids).__name__}; text goes to generate_text")
    token_ids = list(token_ids)
    if not token_ids:  # an empty prompt, reported as such by check_token_ids
        return [[]]
    if all(is_whole_number(t) for t in token_ids):
        return [[int(t) for t in token_ids]]
    rows = []
    for row in token_ids:
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not all(is_whole_number(t) for t in row):
            raise InputError(f"{expected}, found an element {row!r}; convert your ids to ints")
        rows.append([int(t) for t in row])
    return rows


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (up to and including a stop token)
    prefill_seconds: float  # the prompt step, compilation excluded
    decode_seconds: float  # the decode steps, compilation excluded
    decode_steps: int
    compile_seconds: float  # compiling the step programs this generation needed (0 once they are compiled)


def generate_tokens(model, rows: list[list[int]], max_new_tokens: int, sampling: SamplingParams, seed: int,
                    on_tokens: TokenCallback | None = None, routing_override: RoutingOverride | None = None,
                    run_ahead: bool = True) -> GenerationResult:
    """Run prefill + decode for `model` (a jmoe.Model); see Model.generate for the arguments. run_ahead=False reads
    every step back before dispatching the next (the same tokens; benchmarks compare the two)."""
    cfg: ModelConfig = model.config
    check_token_ids(cfg, rows, "generate")
    max_new_tokens, seed = checked_length_and_seed(max_new_tokens, seed)
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"generate: prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({cfg.max_position_embeddings}); lower --max-new-tokens")
    prompt_len = bucket_length(longest)
    cache_len = bucket_length(prompt_len + max_new_tokens)
    batch = len(rows)
    # Rows past the real batch are padding: every column of theirs is padding, so they route nowhere.
    tokens = np.zeros((bucket_batch(batch), prompt_len), np.int32)
    pad_len = np.full(len(tokens), cache_len, np.int32)
    pad_len[:batch] = [prompt_len - len(r) for r in rows]
    for b, row in enumerate(rows):
        tokens[b, pad_len[b]:] = row
    kv_cache = empty_kv_cache(cfg, len(tokens), cache_len, model.kv_dtype)
    key = jax.random.PRNGKey(seed)
    pad_len_dev = jnp.asarray(pad_len)
    stop_ids = set(cfg.eos_token_ids)
    out: list[list[int]] = [[] for _ in rows]
    done = np.zeros(batch, bool)

    def dispatch(tokens, kv_cache, write_index: int, index: int):
        forced = None if routing_override is None else routing_override(index, tokens.shape)
        return model.dispatch_step(tokens, kv_cache, write_index, pad_len_dev, key, index, sampling, forced)

    # Step n + 1 is dispatched on step n's tokens, still on the device, before step n is read back: the host's work
    # between steps (the read, the manager, stop checks, the callback) overlaps the device's next step. When every
    # row stops early, that step was for nothing: its bookkeeping is done, its tokens dropped.
    ahead = run_ahead and model.engine.runs_ahead
    compiled_before = model.compile_seconds
    start = time.perf_counter()
    step = dispatch(tokens, kv_cache, 0, 0)
    steps = 0
    for n in range(max_new_tokens):
        last = n == max_new_tokens - 1
        following = None
        if ahead and not last:
            following = dispatch(step.next_tokens, step.kv_cache, prompt_len + n, n + 1)
        next_tokens = model.finish_dispatched(step)
        if n == 0:
            prefill_compile = model.compile_seconds - compiled_before
            prefill_seconds = time.perf_counter() - start - prefill_compile
            decode_start = time.perf_counter()
        for b in range(batch):
            if not done[b]:
                token = int(next_tokens[b])
                out[b].append(token)
                done[b] = token in stop_ids
        if on_tokens is not None:
            on_tokens(out)
        if done.all() or last:
            if following is not None:
                model.finish_dispatched(following)
            break
        step = following if following is not None else dispatch(next_tokens[:, None], step.kv_cache, prompt_len + n,
                                                                 n + 1)
        steps += 1
    compile_seconds = model.compile_seconds - compiled_before
    decode_seconds = time.perf_counter() - decode_start - (compile_seconds - prefill_compile)
    return GenerationResult(out, prefill_seconds, decode_seconds, steps, compile_seconds)
