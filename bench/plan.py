"""jmoe.plan on the published shapes of large MoE models, for an H100 and an RTX 4090, at a few caches: where
the bytes go, what fits, the plan's speed estimate, and what planning costs (wall time, peak memory).

No weights exist here: each model is a config.json with its published shape and a header-only safetensors
file (every tensor jmoe expects, with its shape and dtype, and no data), written once under --workdir.
Each plan runs in a fresh process (`python -m jmoe.plan --json`), so its peak RSS is its own; the decode and
prefill programs are compiled for the target in that process's children.

    python -m bench.plan [--workdir /tmp/jmoe_plan_bench] [--models mixtral-8x7b,qwen3-30b-a3b]
        [--targets h100,rtx4090] [--context 4096] [--no-compile]
    python -m bench.plan --smoke   # Mixtral-8x7B at smoke size, h100, cache 4, context 64, no result file
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench.common import add_smoke_argument, smoke_run, smoke_spec, write_result

# Published config.json values (Hugging Face hub: mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B,
# Qwen/Qwen3-235B-A22B), with the keys jmoe reads.
MODELS = {
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}
# Qwen3-235B-A22B differs from Qwen3-30B-A3B only in these.
MODELS["qwen3-235b-a22b"] = {**MODELS["qwen3-30b-a3b"], "hidden_size": 4096, "intermediate_size": 12288,
                             "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64}
# Families jmoe does not support on this branch yet (issue 12 adds them): reported as not yet possible.
NOT_YET = {"gpt-oss-120b": "gpt_oss", "deepseek-v3": "deepseek_v3"}
# Caches per model: all experts resident, nothing cached, and one size in between.
CACHES = {"mixtral-8x7b": [None, 0, 4], "qwen3-30b-a3b": [None, 0, 16], "qwen3-235b-a22b": [None, 0, 16]}
# Host RAM assumed next to each GPU (the plan's host_gb): a one-H100 cloud machine, a desktop with an RTX 4090.
HOST_GB = {"h100": 256, "rtx4090": 128}
SMOKE_MODEL, SMOKE_CACHE = "mixtral-8x7b", 4  # a smoke run plans this model at smoke size, this cache only
BF16_BYTES = 2


def write_header_only_checkpoint(directory: Path, config: dict) -> Path:
    """config.json plus one model.safetensors holding only its header: every tensor jmoe's layout table
    expects for this config, at its Hugging Face shape, with data offsets but no data."""
    from jmoe.checkpoint.hf_layout import expected_tensors
    from jmoe.config import parse_config

    if (directory / "model.safetensors").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    header, offset = {}, 0
    for name, target in expected_tensors(parse_config(config)).items():
        size = BF16_BYTES * math.prod(target.hf_shape)
        header[name] = {"dtype": "BF16", "shape": list(target.hf_shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    return directory


PLAN_IN_A_PROCESS = r"""
import json, resource, sys, time
start = time.perf_counter()
from jmoe.cli.plan import build_parser
from jmoe.cli.common import offload_options
from jmoe.plan import plan_with_options
args = build_parser().parse_args(sys.argv[1:])
plan = plan_with_options(args.model, offload_options(args), target=args.target, context=args.context,
                         host_gb=args.host_gb, compile=not args.no_compile)
out = plan.as_dict()
out["wall_seconds"] = time.perf_counter() - start
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
out["cpu_seconds"] = sum(u.ru_utime + u.ru_stime for u in usage)
out["peak_rss_bytes"] = usage[0].ru_maxrss * 1024
out["peak_rss_children_bytes"] = usage[1].ru_maxrss * 1024
print(json.dumps(out))
"""


def plan_row(directory: Path, target: str, cache, context: int, compile_programs: bool) -> dict:
    argv = [str(directory), "--target", target, "--context", str(context), "--host-gb", str(HOST_GB[target])]
    if cache is not None:
        argv += ["--cache", str(cache)]
    if not compile_programs:
        argv.append("--no-compile")
    done = subprocess.run([sys.executable, "-c", PLAN_IN_A_PROCESS, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"plan {argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def smoke_check(row: dict) -> None:
    """Raise unless every program of a plan compiled."""
    failed = {name: p["error"] for name, p in row["programs"].items() if p["error"] is not None}
    if failed:
        raise RuntimeError("programs not compiled: " + "; ".join(f"{n}: {e.strip()[-500:]}" for n, e in failed.items()))
    if not row["programs"]:
        raise RuntimeError("the plan compiled no program")
    if row["estimate"] is None:
        raise RuntimeError("the plan has no speed estimate")


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def speed(row: dict, key: str) -> str:
    """An estimate's [low, high] tokens/s (jmoe.plan's speed estimate), or "-" without one."""
    return "-" if row["estimate"] is None else "{:,.1f} - {:,.1f}".format(*row["estimate"][key])


def table(rows: list[dict]) -> str:
    lines = ["| model | target | cache | pinned host GiB | device weights GiB | slots GiB | KV GiB | decode prog. GiB "
             "| prefill prog. GiB | device total GiB | device avail. GiB | fits | est. decode tok/s | "
             "est. prefill tok/s | plan wall s | plan CPU s | peak RSS MiB (plan / compilers) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        programs = r["programs"]
        prog = {name: (p["device_bytes"] if p["error"] is None else None) for name, p in programs.items()}
        fits = "yes" if r["fits"] else "no: " + "; ".join(reason.split(":")[0] for reason in r["reasons"])
        lines.append(
            f"| {r['name']} | {r['target']['name']} | {r['cache_label']} | {gib(r['host_bytes'])} | "
            f"{gib(r['device_weight_bytes'])} | {gib(r['slot_bytes'])} | {gib(r['kv_bytes'])} | "
            f"{gib(prog.get('decode'))} | {gib(prog.get('prefill'))} | {gib(r['device_bytes'])} | "
            f"{gib(r['available']['device_bytes'])} | {fits} | {speed(r, 'decode_tokens_per_s_batch1')} | "
            f"{speed(r, 'prefill_tokens_per_s')} | {r['wall_seconds']:.0f} | {r['cpu_seconds']:.0f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} / {r['peak_rss_children_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_plan_bench"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default="h100,rtx4090")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true")
    add_smoke_argument(parser)
    args = parser.parse_args()
    with smoke_run(args):
        if args.smoke:
            args.models, args.targets, args.context = SMOKE_MODEL, "h100", 64
        report(args)
    return 0


def models_to_plan(args) -> dict:
    """{name: (config, caches)} of the models in `args.models`; a smoke run's at smoke size, one cache."""
    if args.smoke:
        return {name: (smoke_spec(MODELS[name]), [SMOKE_CACHE]) for name in args.models.split(",")}
    return {name: (MODELS[name], CACHES[name]) for name in args.models.split(",")}


def report(args) -> None:
    began = time.perf_counter()
    load_before = open("/proc/loadavg").read().split()[:3]
    rows, errors = [], []
    for name, (config, caches) in models_to_plan(args).items():
        directory = write_header_only_checkpoint(args.workdir / name, config)
        for target in args.targets.split(","):
            for cache in caches:
                print(f"[{time.perf_counter() - began:6.0f} s] {name} {target} cache={cache}", file=sys.stderr,
                      flush=True)
                try:
                    row = plan_row(directory, target, cache, args.context, not args.no_compile)
                    if args.smoke:  # a real run reports what failed; a smoke run fails on it
                        smoke_check(row)
                except RuntimeError as e:
                    if args.smoke:
                        raise SystemExit(f"plan --smoke: {e}") from None
                    errors.append(str(e))
                    continue
                rows.append({**row, "name": name, "cache_label": "all resident" if cache is None else str(cache)})
    load_after = open("/proc/loadavg").read().split()[:3]
    body = [
        f"Conditions: load average {' '.join(load_before)} before, {' '.join(load_after)} after; whole run "
        f"{time.perf_counter() - began:.0f} s; context {args.context} tokens, batch 1, bfloat16, host RAM assumed "
        f"{', '.join(f'{gb} GiB next to the {t}' for t, gb in HOST_GB.items())}, "
        f"{'programs compiled for each target' if not args.no_compile else 'programs not compiled'}.", "",
        table(rows), "",
        "Estimates: batch-1 decode and a context-long prefill, [low, high] tokens/s, uniform routing (hit rate = "
        "cache / experts); the assumptions (jmoe/plan/estimate.py), for the first row:", "",
        *[f"- {line}" for line in ((rows[0]["estimate"] if rows else None) or {}).get("assumptions", [])], "",
        "Not yet possible on this branch: " + ", ".join(f"{m} (model_type {t})" for m, t in NOT_YET.items())
        + ": jmoe does not support these families yet.",
    ]
    if errors:
        body += ["", "Failed plans:", *[f"- {e}" for e in errors]]
    (args.workdir / "plan_rows.json").write_text(json.dumps(rows))
    print(write_result("plan.md", "jmoe.plan on published MoE shapes", "\n".join(body) + "\n"))


if __name__ == "__main__":
    sys.exit(main())
