"""Command line: `python -m jmoe.generate --model DIR --prompt "..."`.

Streams the generated text to stdout, or with --json prints one JSON object (prompt, token ids, text,
timing). Without --model it runs the default model shipped in the repository's checkpoints/ folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jmoe.errors import JmoeError

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "default"
DEFAULT_PROMPT = "class Parser:\n    def __init__(self"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jmoe.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help=f"Hugging Face model directory (default: the shipped model, {DEFAULT_MODEL_DIR})")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=int, default=None,
                   help="experts per MoE layer kept on the device (default: all); the rest stay in pinned host memory")
    p.add_argument("--policy", default="lfru", help="expert cache policy: lru, lfu, lfru (default), static")
    p.add_argument("--offload-params", nargs="+", default=None, metavar="PATTERN",
                   help="more parameters to keep in host memory: dotted segments (w_down, attn) or 're:REGEX'")
    p.add_argument("--device-budget-gb", type=float, default=None,
                   help="pick the largest cache that fits in this much device memory")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="copy up to N experts per layer ahead of need, guessed from the next layer's router")
    p.add_argument("--miss-mode", choices=("fetch", "host"), default="fetch",
                   help="an expert not on the device: 'fetch' copies it in (default), 'host' computes it on the host")
    p.add_argument("--offload-group-size", type=int, default=0, metavar="G",
                   help="layer-group weight prefetch: in every G layers, keep the last N layers' weights (those "
                        "matched by --offload-params, else all non-expert ones) on the host (0 = off)")
    p.add_argument("--offload-num-in-group", type=int, default=1, metavar="N", help="offloaded layers per group")
    p.add_argument("--offload-prefetch-step", type=int, default=1, metavar="K",
                   help="fetch an offloaded layer's weights when the layer K before it starts")
    p.add_argument("--stats", action="store_true", help="print a per-layer expert cache table after generation")
    p.add_argument("--backend", default="auto", help="expert kernel backend (jmoe.kernels.moe_ffn)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def resolve_model_dir(model: Path | None) -> Path:
    if model is not None:
        return model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise JmoeError(f"no --model given and the default model is not present at {DEFAULT_MODEL_DIR}; "
                        f"pass --model DIR with a Hugging Face MoE checkpoint directory")
    return DEFAULT_MODEL_DIR


def run(args: argparse.Namespace) -> dict:
    import jmoe
    from jmoe.sampling import SamplingParams
    from jmoe.tokenizer import stdout_streamer

    model_dir = resolve_model_dir(args.model)
    model = jmoe.load(model_dir, args.cache, policy=args.policy, offload_params=args.offload_params,
                      device_budget_gb=args.device_budget_gb, prefetch=args.prefetch, miss_mode=args.miss_mode,
                      offload_group_size=args.offload_group_size, offload_num_in_group=args.offload_num_in_group,
                      offload_prefetch_step=args.offload_prefetch_step, backend=args.backend, progress=not args.json)
    tokenizer = model.require_tokenizer()
    if not args.prompt:
        raise JmoeError("--prompt is empty; give some text to continue")
    prompt_ids = tokenizer.encode(args.prompt)
    on_tokens = None
    if not args.json:
        sys.stdout.write(args.prompt)
        on_tokens = stdout_streamer(tokenizer)

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    result = model.generate_detailed([prompt_ids], args.max_new_tokens, sampling, args.seed, on_tokens)
    tokens = result.tokens[0]
    decode_tps = result.decode_steps / result.decode_seconds if result.decode_seconds > 0 else None
    return {
        "model": str(model_dir),
        "prompt": args.prompt,
        "prompt_token_ids": prompt_ids,
        "token_ids": tokens,
        "text": tokenizer.decode(tokens),
        "timing": {"prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
                   "decode_steps": result.decode_steps, "decode_tokens_per_second": decode_tps},
        "cache_stats": model.stats(),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except (JmoeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    print()
    if args.stats:
        print(format_stats(report["cache_stats"]))
    return 0


def format_stats(stats: list[dict]) -> str:
    """Per-layer hit-rate table; says so when every expert is resident."""
    if not stats:
        return "expert cache: every expert is resident on the device (no --cache given), nothing to report"
    lines = [f"{'layer':>5} {'hits':>8} {'misses':>8} {'hit rate':>9} {'evictions':>10} {'MB moved':>10}"]
    for s in stats:
        rate = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"
        lines.append(f"{s['layer']:>5} {s['hits']:>8} {s['misses']:>8} {rate:>9} {s['evictions']:>10} "
                     f"{s['bytes_moved'] / 2**20:>10.2f}")
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    lines.append(f"total hit rate {hits / max(1, hits + misses):.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
