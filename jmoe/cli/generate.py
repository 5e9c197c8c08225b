"""Command line: `python -m jmoe.generate --model DIR --prompt "..."`.

Streams the generated text to stdout, or with --json prints one JSON object (prompt, token ids, text,
timing). Without --model it runs the default model shipped in the repository's checkpoints/ folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jmoe.cli.common import (add_distributed_args, add_model_arg, add_offload_args, distributed_options,
                             load_for_cli, offload_options, resolve_model_dir, run_cli)
from jmoe.errors import JmoeError

if TYPE_CHECKING:
    from jmoe.decode.sampling import SamplingParams

DEFAULT_PROMPT = "class Parser:\n    def __init__(self"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jmoe.generate", description=__doc__.splitlines()[0])
    add_model_arg(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    # Left out, they take generation_config.json's values (Hugging Face's convention), else greedy.
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else 0)")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default: generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default: generation_config.json, else 1)")
    p.add_argument("--seed", type=int, default=0)
    add_offload_args(p)
    add_distributed_args(p)
    p.add_argument("--stats", action="store_true", help="print a per-layer expert cache table after generation")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def run(args: argparse.Namespace) -> dict:
    from jmoe.decode.generation import checked_length_and_seed

    if not args.prompt:
        raise JmoeError("--prompt is empty; give some text to continue")
    options, distributed = offload_options(args), distributed_options(args)
    checked_length_and_seed(args.max_new_tokens, args.seed)  # before anything is loaded or printed
    model_dir = resolve_model_dir(args.model)
    sampling = sampling_params(args, model_dir)
    with load_for_cli(model_dir, options, distributed, backend=args.backend, compile_cache=args.compile_cache,
                      progress=not args.json) as model:
        return generate_report(args, model, model_dir, sampling)


def generate_report(args: argparse.Namespace, model, model_dir: Path, sampling) -> dict:
    from jmoe.decode.streaming import stdout_streamer

    tokenizer = model.require_tokenizer()
    prompt_ids = tokenizer.encode(args.prompt)
    on_tokens = None
    if not args.json:
        sys.stdout.write(args.prompt)
        on_tokens = stdout_streamer(tokenizer)

    result = model.generate_detailed([prompt_ids], args.max_new_tokens, sampling, args.seed, on_tokens)
    tokens = result.tokens[0]
    decode_tps = result.decode_steps / result.decode_seconds if result.decode_seconds > 0 else None
    return {
        "model": str(model_dir),
        "prompt": args.prompt,
        "prompt_token_ids": prompt_ids,
        "token_ids": tokens,
        "text": tokenizer.decode(tokens),
        # Compilation is reported on its own: the other times and the throughput exclude it.
        "timing": {"compile_seconds": result.compile_seconds, "prefill_seconds": result.prefill_seconds,
                   "decode_seconds": result.decode_seconds, "decode_steps": result.decode_steps,
                   "decode_tokens_per_second": decode_tps},
        "cache_stats": model.stats(),
    }


def sampling_params(args: argparse.Namespace, model_dir: Path) -> SamplingParams:
    """--temperature / --top-k / --top-p, each left out taking the checkpoint's generation_config.json value
    (jmoe.serve.generation_defaults: do_sample false = greedy), else greedy, no top-k, no top-p."""
    from jmoe.decode.sampling import SamplingParams
    from jmoe.serve.params import generation_defaults

    defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **generation_defaults(model_dir)}
    given = {name: getattr(args, name) for name in defaults if getattr(args, name) is not None}
    return SamplingParams(**{**defaults, **given})


def format_stats(stats: list[dict]) -> str:
    """Per-layer hit-rate table (a row per device and layer under an expert mesh); says so when every expert is
    resident."""
    if not stats:
        return "expert cache: every expert is resident on the device (no --cache given), nothing to report"
    per_device = any("device" in s for s in stats)
    device = (lambda s: f"{s['device']:>6} ") if per_device else (lambda s: "")
    tiered = any("disk_reads" in s for s in stats)  # the disk tier (--host-budget-gb): its rows and reads
    disk = (lambda s: f" {s['host_rows']:>9} {s['disk_reads']:>10} {s['disk_bytes'] / 2**20:>10.2f}") if tiered else (
        lambda s: "")
    header = f"{'layer':>5} {'slots':>6} {'hits':>8} {'misses':>8} {'hit rate':>9} {'evictions':>10} {'MB moved':>10}"
    header += f" {'host rows':>9} {'disk reads':>10} {'disk MB':>10}" if tiered else ""
    lines = [(f"{'device':>6} " if per_device else "") + header]
    for s in stats:
        rate = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"
        lines.append(f"{device(s)}{s['layer']:>5} {s['cache_slots']:>6} {s['hits']:>8} {s['misses']:>8} {rate:>9} "
                     f"{s['evictions']:>10} {s['bytes_moved'] / 2**20:>10.2f}{disk(s)}")
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    lines.append(f"total hit rate {hits / max(1, hits + misses):.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        report = run(args)
        if args.json:
            print(json.dumps(report))
            return 0
        print()
        if args.stats:
            print(format_stats(report["cache_stats"]))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
