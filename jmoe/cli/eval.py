"""Command line: `python -m jmoe.eval --model DIR --data FILE [--batch-size 8] [--seq-len T] [--json]`
with the same offload flags as jmoe.generate (see jmoe.eval for what is measured)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jmoe.cli.common import (add_distributed_args, add_model_arg, add_offload_args, distributed_options,
                             load_for_cli, offload_options, resolve_model_dir, run_cli)
from jmoe.eval.data import check_data_path
from jmoe.eval.metrics import DEFAULT_BATCH_SIZE, DEFAULT_SEQ_LEN, evaluate_file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jmoe.eval", description=__doc__.splitlines()[0])
    add_model_arg(p)
    p.add_argument("--data", type=Path, required=True,
                   help="token ids (.npy 1-D integer array; .ids whitespace-separated integers) or text "
                        "(.txt .text .md .rst .py, encoded with the model's tokenizer.json)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="windows per batch")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"window length (default: min({DEFAULT_SEQ_LEN}, max_position_embeddings))")
    add_offload_args(p)
    add_distributed_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def run(args: argparse.Namespace) -> dict:
    options, distributed = offload_options(args), distributed_options(args)
    model_dir = resolve_model_dir(args.model)
    data_format = check_data_path(args.data)  # fail on a bad path before the (slow) model load
    model = load_for_cli(model_dir, options, distributed, backend=args.backend, compile_cache=args.compile_cache)
    result = evaluate_file(model, args.data, args.batch_size, args.seq_len, progress=True)
    return {"model": str(model_dir), "data": str(args.data), "data_format": data_format, "cache": args.cache,
            "policy": args.policy, "backend": args.backend, **result.as_dict()}


def format_report(report: dict) -> str:
    steady = report["steady_tokens_per_second"]
    lines = [
        f"perplexity {report['perplexity']:.4f} (mean NLL {report['nll']:.4f} nats over "
        f"{report['predicted_tokens']} predicted tokens)",
        f"{report['tokens']} tokens in {report['windows']} non-overlapping windows of {report['seq_len']}, "
        f"batch size {report['batch_size']}, shapes {report['batch_shapes']}",
        f"{report['tokens_per_second']:.1f} tokens/s overall ({report['seconds']:.2f} s, compilation included)"
        + (f", {steady:.1f} tokens/s after the first batch of each shape" if steady else ""),
        "",
        "| layer | entropy (nats) | entropy / log E | busiest expert | busiest share | load per expert |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["routing"]:
        lines.append(f"| {r['layer']} | {r['entropy_nats']:.3f} | {r['entropy_normalized']:.3f} | "
                     f"{r['busiest_expert']} | {r['busiest_share']:.3f} | {' '.join(map(str, r['load']))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        report = run(args)
        print(json.dumps(report) if args.json else format_report(report))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
