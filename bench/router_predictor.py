"""Precision and recall per MoE layer of the router predictor on the default model's held-out text.

    JAX_PLATFORMS=cpu python -m bench.router_predictor [--seq-len 256] [--batch-size 8]
    JAX_PLATFORMS=cpu python -m bench.router_predictor --smoke   # two windows of 32 tokens per stream, the model's
                                                                 # first two layers, no result

The router predictor (jmoe.traces.router_guess, the engine's in-step prefetch guess) names the
top-N experts of softmax(router_{l+1}(h_l)) for MoE layer l + 1; it is scored per token against the
experts layer l + 1 then chose, for N = k, 4 and 8. For comparison, the history predictors `previous`
and `frequency` (jmoe.offload.predictors) are scored on the same tokens and layers.

Data (as in bench/results/eval.md): the scored stream is functools.py, codecs.py and
email/generator.py of the recipe corpus's validation split, concatenated; `frequency` is fitted on the
routing of the other 36 validation files, so it never sees the scored tokens. Both streams run in
non-overlapping windows of --seq-len tokens, like `python -m jmoe.eval`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.helpers.common import add_smoke_argument, default_model, smoke_run, write_result

import jmoe
from checkpoints.recipe.corpus import load_corpus
from jmoe.eval.metrics import check_stream, pack_windows, padded_batch
from jmoe.offload.predictors import make_predictor
from jmoe.traces.evaluation import precision_recall
from jmoe.traces.router_guess import RouterGuesses, router_guesses

SCORED_FILES = ["functools.py", "codecs.py", "email/generator.py"]  # bench/results/eval.md's held-out text
COUNTS = (2, 4, 8)
SMOKE_SEQ_LEN, SMOKE_WINDOWS = 32, 2  # a smoke run scores and fits on this many windows of this length


def heldout_streams(model, seq_len: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(scored tokens, frequency-fit tokens, names of the fit files): disjoint validation files."""
    validation = load_corpus().validation
    fit_files = [name for name in validation.names if name not in SCORED_FILES]
    return (scored_stream(model, seq_len, validation), validation_stream(model, validation, fit_files, seq_len),
            fit_files)


def scored_stream(model, seq_len: int, validation=None) -> np.ndarray:
    """The scored tokens of heldout_streams (bench/results/eval.md's held-out text), from the recipe corpus's
    `validation` split (loaded when not given)."""
    return validation_stream(model, validation or load_corpus().validation, SCORED_FILES, seq_len)


def validation_stream(model, validation, names: list[str], seq_len: int) -> np.ndarray:
    """The files `names` of the corpus split `validation`, concatenated and encoded by the model's tokenizer."""
    texts = dict(zip(validation.names, validation.texts))
    return check_stream(model.config, model.require_tokenizer().encode("".join(texts[name] for name in names)), seq_len)


def stream_guesses(model, stream: np.ndarray, seq_len: int, batch_size: int) -> RouterGuesses:
    """Router guesses of every real token of `stream`, in stream order (padding left out)."""
    windows, lengths = pack_windows(stream, seq_len)
    parts = []
    for first in range(0, len(windows), batch_size):
        tokens, mask = padded_batch(windows[first:first + batch_size], lengths[first:first + batch_size], batch_size)
        parts.append(router_guesses(model, tokens, mask))
    return RouterGuesses(np.concatenate([p.probs for p in parts]), np.concatenate([p.ids for p in parts]))


def score_rows(guesses: RouterGuesses, fit_ids: np.ndarray, num_experts: int) -> list[tuple[str, int, dict]]:
    """(predictor, N, precision_recall over MoE layers 1 .. L-1) for every predictor and N."""
    k = guesses.ids.shape[2]

    def history(name: str, count: int, ids: np.ndarray) -> dict:
        predictor = make_predictor(name, count=count).fit(ids, num_experts)
        # History predictors guess every layer; score the layers the router predictor guesses.
        return precision_recall(predictor.predict(guesses.ids)[:, 1:], guesses.guessed_ids)

    return ([("router", n, guesses.precision_recall(n)) for n in COUNTS]
            + [("previous (at most k for any N)", k, history("previous", k, fit_ids))]
            + [("frequency", n, history("frequency", n, fit_ids)) for n in COUNTS]
            # Not a usable predictor: shows how much of frequency's result is the shift between files.
            + [("frequency fitted on the scored tokens (in-sample)", n, history("frequency", n, guesses.ids))
               for n in COUNTS])


def format_table(rows: list[tuple[str, int, dict]], num_layers: int) -> str:
    header = ["predictor", "N", "predicted / token"] + [f"layer {l} P / R" for l in range(1, num_layers)]
    lines = ["| " + " | ".join(header + ["pooled P / R"]) + " |", "|---|---:|---:|" + "---:|" * num_layers]
    for name, n, pr in rows:
        cells = [f"{p:.1%} / {r:.1%}" for p, r in zip(pr["layer_precision"], pr["layer_recall"])]
        cells.append(f"**{pr['precision']:.1%} / {pr['recall']:.1%}**")
        lines.append(f"| {name} | {n} | {pr['predicted_per_step']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def weights_md5(directory: Path) -> str:
    return hashlib.md5((directory / "model.safetensors").read_bytes()).hexdigest()


def report(args, directory, model, scored, fit, fit_files, guesses, rows, seconds) -> str:
    cfg = model.config
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    return f"""- No GPU: `JAX_PLATFORMS=cpu`, 2 cores (lscpu: 2 CPUs, 1 thread per core), shared with other jobs.
- Model: `{os.path.relpath(directory)}` (qwen3_moe, {cfg.num_moe_layers} MoE layers, {e} experts, top-{k}, float32;
  `model.safetensors` md5 {weights_md5(directory)}).
- Scored tokens: {len(scored):,}: `{'`, `'.join(SCORED_FILES)}` of the recipe corpus's validation
  split, concatenated without separators, as in [`eval.md`](eval.md); non-overlapping windows of
  {args.seq_len} tokens, batch {args.batch_size}, the last window's padding left out. {len(guesses.ids):,} tokens x
  {cfg.num_moe_layers - 1} guessed layers x top-{k} = {len(guesses.ids) * (cfg.num_moe_layers - 1) * k:,} expert accesses scored.
- `frequency` is fitted on the routing of the other {len(fit_files)} validation files ({len(fit):,} tokens, same
  windows), never on the scored tokens. `previous` reads the previous token of the scored stream.
- Wall time {seconds:.0f} s for both streams (compilation included).

## Definitions

`router`: the guess of `jmoe.traces.router_guess` = what the offload engine's in-step prefetch
computes: while MoE layer l runs, the top-N experts of softmax(router of layer l+1 applied to h_l, the
post-attention-norm hidden state layer l's own router sees). Layer 0 has no layer before it in the same
token, so only layers 1..{cfg.num_moe_layers - 1} are scored, for every predictor. `previous`: the {k} experts the
same layer used at the previous token (never more than {k}, so one row serves every N). `frequency`:
the layer's N most used experts in the fit slice (the same set for every token); the in-sample rows
fit it on the scored tokens themselves, an upper bound for a fixed set, not a usable predictor.

Precision = correct guesses / guesses, recall = correct guesses / experts used ({k} per token and
layer), per token (batch-1 decode semantics: each token gets its own predicted set; the engine, given a
batch, max-pools the router's probabilities over the batch's tokens instead), pooled over all tokens
(pooled column: over layers too). A random guess of N experts has precision {k}/{e} = {k / e:.1%} and
recall N/{e}.

## Results

{format_table(rows, cfg.num_moe_layers)}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256, help="window length, as in bench/results/eval.md")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    with smoke_run(args):
        if args.smoke:
            args.seq_len, args.batch_size = SMOKE_SEQ_LEN, SMOKE_WINDOWS
        score(args)
    return 0


def score(args) -> None:
    directory = default_model(args)
    model = jmoe.load(directory, progress=False)
    scored, fit, fit_files = heldout_streams(model, args.seq_len)
    if args.smoke:
        scored, fit = scored[:SMOKE_WINDOWS * args.seq_len], fit[:SMOKE_WINDOWS * args.seq_len]
    start = time.perf_counter()
    guesses = stream_guesses(model, scored, args.seq_len, args.batch_size)
    fit_ids = stream_guesses(model, fit, args.seq_len, args.batch_size).ids
    seconds = time.perf_counter() - start
    rows = score_rows(guesses, fit_ids, model.config.num_experts)
    body = report(args, directory, model, scored, fit, fit_files, guesses, rows, seconds)
    path = write_result("router_predictor.md", "Router predictor: precision and recall per layer (default model)",
                        body)
    print(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
