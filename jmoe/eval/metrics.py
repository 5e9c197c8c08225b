"""Batched evaluation over a token stream: perplexity, throughput, per-MoE-layer routing statistics.

    python -m jmoe.eval --model DIR --data FILE [--batch-size 8] [--seq-len T] [--cache N ...] [--json]

Windows: the stream is cut into NON-overlapping windows of seq_len tokens (the last one may be
shorter). Each window predicts its tokens 2..n from the tokens before them in the same window, so a
window's first token is never scored and no context crosses a window boundary. Perplexity is
exp(mean NLL) over all predicted tokens.

Shapes: every batch runs through `Model.logits_and_routing` as [b, seq_len]: b = batch_size for full
batches, and for the last batch the next power of two >= its window count (at most batch_size), so at
most 1 + log2(batch_size) shapes compile. The short last window and the extra rows are padded; padded
positions are masked out of the loss and the routing statistics (attention is causal, so padding after
a window's real tokens cannot change them).

Routing: per MoE layer, the (token, choice) pairs each expert received over every real token (each
window's last token included: it is forwarded although it predicts nothing), so a layer's load sums to
tokens x top_k. Entropy is that of the load distribution, in nats and divided by log(num_experts).

Processes (a jax.distributed run, jmoe.distributed): each process evaluates its own contiguous share of the
windows in whole batches, and the sums (NLL, tokens, expert load) are added up over the processes, so every
process reports the same result as one process would; times are the slowest process's, so tokens/s is the
aggregate rate; batch_shapes are the shapes this process ran.

Data formats are described in jmoe.eval_data (.npy, .ids, text with the model's tokenizer.json).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jmoe.config import ModelConfig
from jmoe.distributed import max_over_processes, process_share, sum_over_processes
from jmoe.errors import InputError
from jmoe.eval.data import read_tokens
from jmoe.offload.policies import expert_counts

DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 256  # capped at the model's max_position_embeddings when seq_len is not given


@dataclasses.dataclass
class LayerRouting:
    layer: int  # index among all decoder layers (dense layers have no entry)
    load: list[int]  # (token, choice) pairs per expert
    entropy_nats: float
    entropy_normalized: float  # entropy / log(num_experts): 1 = perfectly even load
    busiest_expert: int
    busiest_share: float  # the busiest expert's share of the layer's (token, choice) pairs


@dataclasses.dataclass
class EvalResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token, nats
    tokens: int  # real tokens forwarded
    predicted_tokens: int  # tokens scored: tokens minus one per window
    windows: int
    batch_size: int
    seq_len: int
    batch_shapes: list[list[int]]  # the distinct [b, seq_len] shapes run, each compiled once
    seconds: float  # wall time of the whole loop, first-call compilation included
    tokens_per_second: float
    steady_tokens_per_second: float | None  # batches after the first of their shape; None if there are none
    routing: list[LayerRouting]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@jax.jit
def _nll_sum(logits, tokens, mask):
    """Sum over unmasked targets of -log p(token t+1 | tokens <= t)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(mask[:, 1:], nll, 0.0))


def resolve_seq_len(cfg: ModelConfig, batch_size: int, seq_len: int | None) -> int:
    if batch_size < 1:
        raise InputError(f"batch size must be >= 1, found {batch_size}; change --batch-size (batch_size=)")
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, cfg.max_position_embeddings)
    if seq_len < 2:
        raise InputError(f"sequence length must be >= 2 (a window predicts its tokens 2..n), found {seq_len}; "
                         f"change --seq-len (seq_len=)")
    if seq_len > cfg.max_position_embeddings:
        raise InputError(f"sequence length {seq_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}); lower --seq-len (seq_len=)")
    return seq_len


def check_stream(cfg: ModelConfig, token_ids, seq_len: int) -> np.ndarray:
    """token_ids as an int32 [N] array, or an InputError saying what is wrong with them."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InputError(f"eval data: expected a 1-D token stream, found shape {arr.shape}; flatten it")
    if arr.size == 0:
        raise InputError("eval data: expected tokens, found none; give a non-empty --data file")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"eval data: expected integer token ids, found dtype {arr.dtype}")
    if arr.size < seq_len:
        raise InputError(f"eval data: found {arr.size} tokens, fewer than one window of {seq_len}; "
                         f"lower --seq-len (seq_len=) or give more data")
    bad = np.flatnonzero((arr < 0) | (arr >= cfg.vocab_size))
    if bad.size:
        raise InputError(f"eval data: token id {int(arr[bad[0]])} at position {int(bad[0])} is outside the "
                         f"vocabulary [0, {cfg.vocab_size}) ({bad.size} such ids); was the data tokenised "
                         f"for another model?")
    return arr.astype(np.int32)


def pack_windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows int32 [W, seq_len] zero-padded at the end, real length of each window [W])."""
    count = -(-stream.size // seq_len)
    windows = np.zeros(count * seq_len, np.int32)
    windows[:stream.size] = stream
    lengths = np.full(count, seq_len)
    lengths[-1] = stream.size - (count - 1) * seq_len
    return windows.reshape(count, seq_len), lengths


def padded_batch(windows: np.ndarray, lengths: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to batch_size windows as (tokens [b, T], real-position mask [b, T]) with b a bucketed row count."""
    rows = min(batch_size, 1 << (len(windows) - 1).bit_length())
    tokens = np.zeros((rows, windows.shape[1]), np.int32)
    tokens[:len(windows)] = windows
    real = np.zeros(rows, np.int64)
    real[:len(lengths)] = lengths
    return tokens, np.arange(windows.shape[1])[None, :] < real[:, None]


def expert_load(routing: np.ndarray, mask: np.ndarray, num_experts: int) -> np.ndarray:
    """routing int [L, b, T, k] -> int64 [L, E]: (token, choice) pairs per expert at real positions."""
    return expert_counts(routing[:, mask], num_experts)


def layer_routing(layer: int, load: np.ndarray) -> LayerRouting:
    share = load / load.sum()
    nonzero = share[share > 0]
    entropy = float(-(nonzero * np.log(nonzero)).sum())
    # A single expert is trivially an even load (and log(1) = 0 cannot normalise).
    normalized = entropy / math.log(load.size) if load.size > 1 else 1.0
    busiest = int(load.argmax())
    return LayerRouting(layer, [int(c) for c in load], entropy, normalized, busiest, float(share[busiest]))


def evaluate(model, token_ids, batch_size: int = DEFAULT_BATCH_SIZE, seq_len: int | None = None,
             progress: bool = False) -> EvalResult:
    """Evaluate `model` (a jmoe.Model) on a 1-D token stream; see the module docstring for definitions.

    seq_len: window length (default: min(256, max_position_embeddings)).
    progress: show a tqdm bar on stderr.
    """
    cfg = model.config
    seq_len = resolve_seq_len(cfg, batch_size, seq_len)
    stream = check_stream(cfg, token_ids, seq_len)
    windows, lengths = pack_windows(stream, seq_len)
    mine = process_share(len(windows), batch_size)  # all of them in a single process
    nll_total, predicted = 0.0, 0
    load = np.zeros((cfg.num_moe_layers, cfg.num_experts), np.int64)
    shapes: list[tuple[int, int]] = []
    steady_tokens, steady_seconds = 0, 0.0
    start = time.perf_counter()
    with tqdm(total=int(lengths[mine].sum()), unit="tok", desc="eval", disable=not progress, file=sys.stderr) as bar:
        for first in range(mine.start, mine.stop, batch_size):
            batch_start = time.perf_counter()
            last = min(first + batch_size, mine.stop)
            real = lengths[first:last]
            tokens, mask = padded_batch(windows[first:last], real, batch_size)
            logits, routing = model.logits_and_routing(tokens)
            nll_total += float(_nll_sum(logits, jnp.asarray(tokens), jnp.asarray(mask)))
            predicted += int(mask[:, 1:].sum())
            load += expert_load(routing, mask, cfg.num_experts)
            if tokens.shape in shapes:
                steady_tokens += int(real.sum())
                steady_seconds += time.perf_counter() - batch_start
            else:
                shapes.append(tokens.shape)
            bar.update(int(real.sum()))
    nll_total = float(sum_over_processes(np.array([nll_total]))[0])
    steady_seconds = max_over_processes(steady_seconds)
    counts = sum_over_processes(np.concatenate([[predicted, steady_tokens], load.ravel()]))
    predicted, steady_tokens, load = int(counts[0]), int(counts[1]), counts[2:].reshape(load.shape)
    seconds = max_over_processes(time.perf_counter() - start)
    nll = nll_total / predicted
    return EvalResult(
        perplexity=math.exp(nll), nll=nll, tokens=int(stream.size), predicted_tokens=predicted,
        windows=len(windows), batch_size=batch_size, seq_len=seq_len, batch_shapes=[list(s) for s in shapes],
        seconds=seconds, tokens_per_second=stream.size / seconds,
        steady_tokens_per_second=steady_tokens / steady_seconds if steady_tokens else None,
        routing=[layer_routing(layer, c) for layer, c in zip(cfg.moe_layer_indices, load)])


def evaluate_file(model, path: str | Path, batch_size: int = DEFAULT_BATCH_SIZE, seq_len: int | None = None,
                  progress: bool = False) -> EvalResult:
    """evaluate() on a data file: .npy / .ids token ids, or text encoded with the model's tokenizer."""
    return evaluate(model, read_tokens(path, model.tokenizer), batch_size, seq_len, progress)
