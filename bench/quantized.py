"""Quantized experts (`expert_dtype`): quality against full precision and bytes / speed per decode step.

  python -m bench.quantized [--part all|quality|speed|random] [--tokens 64] [--repeats 3]
  python -m bench.quantized --smoke   # every part at toy size, few formats, no result file

quality: the default model on the held-out text of bench/results/eval.md: perplexity and top-1 agreement of
    every scored token's next-token argmax with the float32 model, per format (and int4 group size).
speed: the default model, batch-1 greedy decode at cache 4 of 16 and resident, per format: expert bytes
    copied per decode step (from the engine's statistics) and decode tokens/s, formats alternated, medians.
random: the 215M-parameter random Mixtral of bench/decode.py: top-1 agreement on random token windows,
    bytes per decode step and decode tokens/s at cache 4 of 16 and resident.

A smoke run (compiling is most of its time, one program per format and cache), the default model cut to its first
two layers (bench.helpers.common.default_model): quality float32 against int4 g32 (a group size set) on 2 windows;
speed int4 at cache 4 only; random at smoke size, float32 only, its speed resident only (so both engines and both
measuring orders run once); 2 new tokens, one run per row.
tests/test_quantized.py covers the formats themselves.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import jmoe
from bench.decode import COMPARE_MODELS, PROMPT, compare_models
from bench.helpers.common import (add_smoke_argument, default_model, run_parts, smoke_run, write_random_checkpoint,
                                  write_result, write_smoke_checkpoint)
from bench.router_predictor import scored_stream
from jmoe.decode.sampling import SamplingParams
from jmoe.eval.metrics import evaluate, pack_windows, padded_batch

# (label, expert_dtype, int4 group size); None = the checkpoint's float32.
QUALITY_FORMATS = [("float32", None, None), ("bfloat16", "bfloat16", None), ("int8", "int8", None),
                   ("int4 g32", "int4", 32), ("int4 g64 (default)", "int4", 64), ("int4 g96", "int4", 96),
                   ("fp8", "fp8", None), ("mxfp4", "mxfp4", None)]
SPEED_FORMATS = [("float32", None), ("int8", "int8"), ("int4", "int4"), ("fp8", "fp8"), ("mxfp4", "mxfp4")]
# A smoke run's rows per part (every format runs the same code here; tests/test_quantized.py covers the formats
# themselves): the formats, and the caches of the speed rows.
SMOKE_FORMATS = {"quality": ("float32", "int4 g32"), "speed": ("int4",), "random": ("float32",)}
CACHE = 4
SMOKE_CACHES = {"speed": (CACHE,), "random": (None,)}
SEQ_LEN, BATCH = 256, 8
SMOKE_WINDOWS = 2  # windows of held-out text (quality) and of random tokens (random) in a smoke run


def formats(table: list[tuple], smoke: bool, part: str) -> list[tuple]:
    """The rows of a format table a run measures: all, or a smoke run's SMOKE_FORMATS of `part`."""
    return [row for row in table if row[0] in SMOKE_FORMATS[part]] if smoke else table


def caches(smoke: bool, part: str) -> tuple:
    """The caches a part's speed rows measure: 4 of 16 and resident, or a smoke run's SMOKE_CACHES of `part`."""
    return SMOKE_CACHES[part] if smoke else (CACHE, None)


def argmax_tokens(model, windows, lengths) -> np.ndarray:
    """Next-token argmax at every scored position (positions 1.. of each window's real tokens)."""
    picks = []
    for first in range(0, len(windows), BATCH):
        tokens, mask = padded_batch(windows[first:first + BATCH], lengths[first:first + BATCH], BATCH)
        top = np.asarray(model.logits(tokens)).argmax(-1)[:, :-1]
        picks.append(top[mask[:, 1:].astype(bool)])
    return np.concatenate(picks)


def part_quality(args, log) -> str:
    rows, reference, stream = [], None, None
    for label, expert_dtype, group in formats(QUALITY_FORMATS, args.smoke, "quality"):
        log(f"quality {label}")
        model = jmoe.load(default_model(args), expert_dtype=expert_dtype, expert_group_size=group, progress=False)
        if stream is None:  # the same tokens for every format
            stream = scored_stream(model, SEQ_LEN)[:SMOKE_WINDOWS * SEQ_LEN if args.smoke else None]
        result = evaluate(model, stream, batch_size=BATCH, seq_len=SEQ_LEN)
        picks = argmax_tokens(model, *pack_windows(stream, SEQ_LEN))
        if reference is None:
            reference = (result.perplexity, picks, model.placement_plan.expert_bytes)
        ppl, ref_picks, ref_bytes = reference
        rows.append(f"| {label} | {model.placement_plan.expert_bytes:,} | "
                    f"{model.placement_plan.expert_bytes / ref_bytes:.3f} | {result.perplexity:.4f} | "
                    f"{(result.perplexity / ppl - 1) * 100:+.2f}% | {np.mean(picks == ref_picks) * 100:.2f}% |")
    return ("## Quality: default model, held-out text\n\n"
            f"{len(reference[1]):,} scored tokens (windows of {SEQ_LEN}, batch {BATCH}, experts resident; quantization "
            "does not depend on the cache: tests/test_quantized.py checks that results are identical at every cache "
            "size within a format). Top-1 agreement: the next-token argmax equals float32's.\n\n"
            "| experts | bytes per expert | vs float32 | perplexity | vs float32 | top-1 agreement |\n"
            "|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def decode_measure(model, tokens: int) -> tuple[float, float]:
    """(decode tokens/s, expert bytes copied per decode step) at batch 1: two runs from an empty cache, one
    with 1 new token (the prompt's copies) and one with `tokens`, so their difference is the decode steps'."""
    moved = []
    for count in (1, tokens):
        model.set_policy("lfru")
        result = model.generate_detailed([PROMPT], count, SamplingParams())
        moved.append(sum(layer["bytes_moved"] for layer in model.stats()))
    return result.decode_steps / result.decode_seconds, (moved[1] - moved[0]) / (tokens - 1)


def speed_rows(directory, formats, tokens: int, repeats: int, log, alternate: bool,
               caches=(CACHE, None)) -> list[str]:
    """Rows of decode tokens/s and bytes per step per (format, cache); medians over `repeats` runs."""
    configs = [(label, expert_dtype, cache) for label, expert_dtype in formats for cache in caches]
    runs: dict[tuple, list] = {c: [] for c in configs}
    models = {}

    def measure(config):
        label, expert_dtype, cache = config
        if config not in models:
            models[config] = jmoe.load(directory, cache=cache, expert_dtype=expert_dtype, progress=False)
            decode_measure(models[config], tokens)  # compiles
        runs[config].append(decode_measure(models[config], tokens))
        log(f"{label} cache={cache}: {runs[config][-1][0]:.1f} tok/s")

    if alternate:  # small models: all loaded at once, formats alternated
        for _ in range(repeats):
            for config in configs:
                measure(config)
    else:  # big models: one at a time
        for config in configs:
            for _ in range(repeats):
                measure(config)
            models.pop(config)
    rows = []
    for label, expert_dtype, cache in configs:
        speeds, moved = zip(*runs[(label, expert_dtype, cache)])
        cache_text = f"{CACHE} of 16" if cache else "resident"
        rows.append(f"| {label} | {cache_text} | {np.median(moved) / 2**20:.3f} | {np.median(speeds):.1f} | "
                    f"{min(speeds):.1f}-{max(speeds):.1f} |")
    return rows


SPEED_HEADER = ("| experts | cache | MiB copied per decode step | decode tokens/s (median) | range |\n"
                "|---|---|---:|---:|---:|\n")


def part_speed(args, log) -> str:
    rows = speed_rows(default_model(args), formats(SPEED_FORMATS, args.smoke, "speed"), args.tokens, args.repeats, log,
                      alternate=True, caches=caches(args.smoke, "speed"))
    return (f"## Speed: default model, batch-1 greedy decode on CPU\n\nPrompt of {len(PROMPT)} tokens, "
            f"{args.tokens} new tokens, policy lfru from an empty cache each run; {args.repeats} runs per row, the "
            "formats alternated, compile excluded. On this CPU a host-to-device copy is a memcpy, so the bytes "
            "column, not tokens/s, is what carries over to a GPU's PCIe link.\n\n" + SPEED_HEADER + "\n".join(rows)
            + "\n")


def part_random(args, log) -> str:
    write = write_smoke_checkpoint if args.smoke else write_random_checkpoint  # smoke: no PyTorch to import
    directory = write(Path(args.workdir) / "mixtral_215m", seed=0, **compare_models(args.smoke)["mixtral"])
    windows = np.random.default_rng(0).integers(0, COMPARE_MODELS["mixtral"]["vocab_size"],
                                                (SMOKE_WINDOWS, 16) if args.smoke else (8, 128))
    lengths = np.full(len(windows), windows.shape[1])
    agreement, reference = [], None
    for label, expert_dtype in formats(SPEED_FORMATS, args.smoke, "random"):
        log(f"random model agreement {label}")
        model = jmoe.load(directory, expert_dtype=expert_dtype, progress=False)
        picks = argmax_tokens(model, windows, lengths)
        reference = picks if reference is None else reference
        agreement.append(f"| {label} | {model.placement_plan.expert_bytes:,} | {np.mean(picks == reference) * 100:.2f}% |")
        del model
    rows = speed_rows(directory, formats(SPEED_FORMATS, args.smoke, "random"), args.tokens, args.repeats, log,
                      alternate=False, caches=caches(args.smoke, "random"))
    return ("## The 215M random Mixtral (bench/decode.py): agreement and speed\n\n"
            "Top-1 agreement over 8 random windows of 128 tokens (random weights: a check that quantization keeps "
            "the function, not a quality figure).\n\n| experts | bytes per expert | top-1 agreement |\n"
            "|---|---:|---:|\n" + "\n".join(agreement) + "\n\nDecode, as for the default model but each "
            f"configuration measured {args.repeats} times in a row (one model in memory at a time):\n\n"
            + SPEED_HEADER + "\n".join(rows) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "quality", "speed", "random"), default="all")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "jmoe_bench"))
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    with smoke_run(args):
        if args.smoke:
            args.tokens, args.repeats = 2, 1
        write_report(args)


def write_report(args) -> None:
    sections, conditions = run_parts(args, {"quality": part_quality, "speed": part_speed, "random": part_random})
    path = write_result(f"quantized{'' if args.part == 'all' else '_' + args.part}.md",
                        "Quantized experts on CPU", f"Conditions: {conditions}.\n\n" + "\n".join(sections))
    print(path.read_text())


if __name__ == "__main__":
    main()
