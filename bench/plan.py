"""jmoe.plan on the published shapes of large MoE models, for an H100 and an RTX 4090 (the largest models also
for one host's 4 and 8 H100s, experts split over them), at a few caches: where the bytes go, what fits, the plan's
speed estimate next to what other engines publish, and what planning costs (wall time, peak memory).

No weights exist here: each model is a config.json with its published shape and a header-only safetensors
file (every tensor jmoe expects, with its shape and dtype, and no data), written once under --workdir.
Each plan runs in a fresh process (`python -m jmoe.plan --json`), so its peak RSS is its own; the decode and
prefill programs are compiled for the target in that process's child, side by side (the compilers' peak RSS holds
both).

    python -m bench.plan [--workdir /tmp/jmoe_plan_bench] [--models "mixtral-8x7b,deepseek-v3 (fp8)"]
        [--targets h100,rtx4090,4xh100,8xh100] [--context 4096] [--no-compile] [--extrapolate-layers]
    python -m bench.plan --smoke   # Mixtral-8x7B at smoke size (one layer), h100, cache 4, context 64, no result file
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench.helpers.common import add_smoke_argument, smoke_run, smoke_spec, write_result

# Published config.json values (Hugging Face hub: mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B,
# Qwen/Qwen3-235B-A22B, and the repositories named below), with the keys jmoe reads.
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
# openai/gpt-oss-120b (its experts ship MXFP4: planned as bf16 headers quantized to mxfp4 at load, the same bytes).
MODELS["gpt-oss-120b"] = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0, "attention_bias": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
# deepseek-ai/DeepSeek-V3 (experts ship fp8 in 128 x 128 blocks; planned in fp8 and in int4).
MODELS["deepseek-v3"] = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture with 384 experts, 64 heads, one expert group.
MODELS["kimi-k2"] = {**MODELS["deepseek-v3"], "model_type": "kimi_k2", "vocab_size": 163840,
                     "first_k_dense_replace": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
                     "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
                     "max_position_embeddings": 131072, "rope_theta": 50000,
                     "rope_scaling": {**MODELS["deepseek-v3"]["rope_scaling"], "factor": 32.0}}
# zai-org/GLM-4.5-Air.
MODELS["glm-4.5-air"] = {
    "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 46, "first_k_dense_replace": 1, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "n_routed_experts": 128,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "use_qk_norm": False, "attention_bias": True, "max_position_embeddings": 131072,
    "rope_theta": 1000000, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Rows: name -> (model, expert_dtype or None = as the checkpoint stores them).
ROWS = {"mixtral-8x7b": ("mixtral-8x7b", None), "qwen3-30b-a3b": ("qwen3-30b-a3b", None),
        "qwen3-235b-a22b": ("qwen3-235b-a22b", None), "gpt-oss-120b (mxfp4)": ("gpt-oss-120b", "mxfp4"),
        "deepseek-v3 (fp8)": ("deepseek-v3", "fp8"), "deepseek-v3 (int4)": ("deepseek-v3", "int4"),
        "kimi-k2 (fp8)": ("kimi-k2", "fp8"), "kimi-k2 (int4)": ("kimi-k2", "int4"),
        "glm-4.5-air": ("glm-4.5-air", None)}
# Caches per model (per device under expert parallelism): all experts resident, nothing cached, one size between.
CACHES = {"mixtral-8x7b": [None, 0, 4], "qwen3-30b-a3b": [None, 0, 16], "qwen3-235b-a22b": [None, 0, 16],
          "gpt-oss-120b": [None, 0, 16], "deepseek-v3": [None, 0, 16], "kimi-k2": [None, 0, 16],
          "glm-4.5-air": [None, 0, 16]}
# Targets: a shipped GPU, or N of them on one host ("8xh100": expert parallelism, jmoe.plan's devices=8).
TARGETS = ["h100", "rtx4090", "4xh100", "8xh100"]
# The targets a row is planned on when asked for (default: the one-GPU ones): the largest models also on one
# host's 4 and 8 H100s, and Kimi K2 in fp8 (1 TB of experts) only there.
ROW_TARGETS = {"deepseek-v3 (fp8)": TARGETS, "deepseek-v3 (int4)": TARGETS, "kimi-k2 (int4)": TARGETS,
               "kimi-k2 (fp8)": ["4xh100", "8xh100"]}
ONE_GPU = ["h100", "rtx4090"]
# Host RAM assumed (the plan's host_gb): a one-H100 cloud machine, a desktop with an RTX 4090, and the hosts of
# 4 and 8 H100 SXM (an 8-GPU HGX / DGX H100 host has 2 TB).
HOST_GB = {"h100": 256, "rtx4090": 128, "4xh100": 1024, "8xh100": 2048}
SMOKE_MODEL, SMOKE_CACHE = "mixtral-8x7b", 4  # a smoke run plans this model at smoke size, this cache only
SMOKE_LAYERS = 1  # of SMOKE_MODEL: XLA:GPU compiles every layer on its own, and each adds seconds of CPU
BF16_BYTES = 2
EXTRAPOLATED = " (deep models at two shallow depths, extrapolated: their programs' temporaries not counted)"


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
from jmoe.cli.plan import build_parser, plan_from_args
out = plan_from_args(build_parser().parse_args(sys.argv[1:])).as_dict()
out["wall_seconds"] = time.perf_counter() - start
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
out["cpu_seconds"] = sum(u.ru_utime + u.ru_stime for u in usage)
out["peak_rss_bytes"] = usage[0].ru_maxrss * 1024
out["peak_rss_children_bytes"] = usage[1].ru_maxrss * 1024
print(json.dumps(out))
"""


def gpus(target: str) -> tuple[str, int]:
    """"8xh100" -> ("h100", 8); "h100" -> ("h100", 1)."""
    count, _, name = target.partition("x") if re.fullmatch(r"\d+x\w+", target) else ("1", "", target)
    return name, int(count)


def plan_row(directory: Path, target: str, cache, context: int, compile_programs: bool,
             expert_dtype: str | None = None, extrapolate_layers: bool = False) -> dict:
    gpu, devices = gpus(target)
    argv = [str(directory), "--target", gpu, "--context", str(context), "--host-gb", str(HOST_GB[target])]
    if devices > 1:
        argv += ["--devices", str(devices)]
    if extrapolate_layers:
        argv.append("--extrapolate-layers")
    if cache is not None:
        argv += ["--cache", str(cache)]
    if expert_dtype is not None:
        argv += ["--expert-dtype", expert_dtype]
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


def compiled_layers(row: dict) -> str:
    """"all 32", or the two shallow depths a deep model's programs were compiled at (extrapolate_layers)."""
    depths = {tuple(p["compiled_layers"]) for p in row["programs"].values() if p["compiled_layers"]}
    if not row["programs"]:
        return "-"
    return " + ".join(map(str, depths.pop())) + " of " + str(row["model"]["layers"]) if depths else (
        f"all {row['model']['layers']}")


def unfit_reasons(row: dict) -> str:
    """What a plan that does not fit runs out of, e.g. "host memory; device memory"."""
    return "; ".join(reason.split(":")[0] for reason in row["reasons"])


def labelled(row: dict, name: str, target: str, cache) -> dict:
    """A plan's row with the names the tables show: its bench row, target ("8xh100") and cache."""
    return {**row, "name": name, "target_label": target, "cache_label": "all resident" if cache is None else str(cache)}


def table(rows: list[dict]) -> str:
    lines = ["| model | target | cache | pinned host GiB | device weights GiB | slots GiB | KV GiB | decode prog. GiB "
             "| prefill prog. GiB | device total GiB | device avail. GiB | fits | est. decode tok/s | "
             "est. prefill tok/s | layers compiled | plan wall s | plan CPU s | peak RSS MiB (plan / compilers) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        programs = r["programs"]
        prog = {name: (p["device_bytes"] if p["error"] is None else None) for name, p in programs.items()}
        fits = "yes" if r["fits"] else "no: " + unfit_reasons(r)
        lines.append(
            f"| {r['name']} | {r['target_label']} | {r['cache_label']} | {gib(r['host_bytes'])} | "
            f"{gib(r['device_weight_bytes'])} | {gib(r['slot_bytes'])} | {gib(r['kv_bytes'])} | "
            f"{gib(prog.get('decode'))} | {gib(prog.get('prefill'))} | {gib(r['device_bytes'])} | "
            f"{gib(r['available']['device_bytes'])} | {fits} | {speed(r, 'decode_tokens_per_s_batch1')} | "
            f"{speed(r, 'prefill_tokens_per_s')} | {compiled_layers(r)} | {r['wall_seconds']:.0f} | "
            f"{r['cpu_seconds']:.0f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} / {r['peak_rss_children_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def rate(value) -> str:
    """A published tokens/s: a number, a [low, high] range, or not published."""
    if value is None:
        return "-"
    return f"{value[0]:g} - {value[1]:g}" if isinstance(value, list) else f"{value:g}"


def published(rows: list[dict]) -> str:
    """What other engines publish for the models planned (bench/helpers/plan_peers.py, with sources), next to the plan's
    batch-1 decode estimate on the same card at each cache (marked where it does not fit: with the peer's host
    RAM or quantized dense weights it might)."""
    from bench.helpers.plan_peers import PEERS

    planned = {r["name"] for r in rows}
    lines = ["| model | card | engine | setting | published decode tok/s | published prefill tok/s | jmoe estimate, "
             "decode batch 1 (cache: low - high) | source |", "|---|---|---|---|---:|---:|---|---|"]
    for peer in PEERS:
        if peer["model"] not in planned:
            continue
        same_card = [r for r in rows if r["name"] == peer["model"] and r["target_label"] == peer["target"]]
        ours = "; ".join(f"{r['cache_label']}: {speed(r, 'decode_tokens_per_s_batch1')}"
                         + ("" if r["fits"] else f" (does not fit: {unfit_reasons(r)})")
                         for r in same_card if r["estimate"] is not None) or (
            "another card: not planned" if not same_card else "no estimate")
        lines.append(f"| {peer['model']} | {peer['gpu']} | {peer['engine']} | {peer['setting']} | "
                     f"{rate(peer['decode_tokens_per_s'])} | {rate(peer['prefill_tokens_per_s'])} | {ours} | "
                     f"{peer['source']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_plan_bench"))
    parser.add_argument("--models", default=",".join(ROWS), help=f"rows to plan: {', '.join(ROWS)}")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"some of {', '.join(TARGETS)}; a row is planned on those of its targets asked for")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--extrapolate-layers", action="store_true",
                        help="compile deep models at two shallow depths (jmoe.plan's extrapolate_layers: minutes "
                             "less per plan; the programs' temporaries are then not counted)")
    add_smoke_argument(parser)
    args = parser.parse_args()
    with smoke_run(args):
        if args.smoke:
            args.models, args.targets, args.context = SMOKE_MODEL, "h100", 64
        report(args)
    return 0


def models_to_plan(args) -> dict:
    """{row name: (model name, config, caches, expert_dtype)} of the rows in `args.models`; a smoke run's at smoke
    size, one cache."""
    unknown = sorted(set(args.models.split(",")) - set(ROWS))
    if unknown:
        raise SystemExit(f"error: unknown --models {unknown}; expected some of {', '.join(ROWS)}")
    rows = {row: ROWS[row] for row in args.models.split(",")}
    if args.smoke:
        return {row: (model, smoke_spec(MODELS[model], num_hidden_layers=SMOKE_LAYERS), [SMOKE_CACHE], dtype)
                for row, (model, dtype) in rows.items()}
    return {row: (model, MODELS[model], CACHES[model], dtype) for row, (model, dtype) in rows.items()}


def report(args) -> None:
    began = time.perf_counter()
    load_before = open("/proc/loadavg").read().split()[:3]
    rows, errors = [], []
    unknown = sorted(set(args.targets.split(",")) - set(TARGETS))
    if unknown:
        raise SystemExit(f"error: unknown --targets {unknown}; expected some of {', '.join(TARGETS)}")
    for name, (model, config, caches, expert_dtype) in models_to_plan(args).items():
        directory = write_header_only_checkpoint(args.workdir / model, config)
        for target in [t for t in args.targets.split(",") if t in ROW_TARGETS.get(name, ONE_GPU)]:
            for cache in caches:
                print(f"[{time.perf_counter() - began:6.0f} s] {name} {target} cache={cache}", file=sys.stderr,
                      flush=True)
                try:
                    row = plan_row(directory, target, cache, args.context, not args.no_compile, expert_dtype,
                                   args.extrapolate_layers)
                    if args.smoke:  # a real run reports what failed; a smoke run fails on it
                        smoke_check(row)
                except RuntimeError as e:
                    if args.smoke:
                        raise SystemExit(f"plan --smoke: {e}") from None
                    errors.append(str(e))
                    continue
                rows.append(labelled(row, name, target, cache))
    load_after = open("/proc/loadavg").read().split()[:3]
    body = [
        f"Conditions: load average {' '.join(load_before)} before, {' '.join(load_after)} after; whole run "
        f"{time.perf_counter() - began:.0f} s; context {args.context} tokens, batch 1, bfloat16, host RAM assumed "
        f"{', '.join(f'{gb} GiB next to the {t}' for t, gb in HOST_GB.items())}, "
        f"{'programs compiled for each target' if not args.no_compile else 'programs not compiled'}; on N x h100 "
        f"(expert parallelism over one host's N GPUs, caches per GPU) the device columns are one GPU's and pinned "
        f"host the host's"
        f"{EXTRAPOLATED if args.extrapolate_layers else ''}.", "",
        table(rows),
    ]
    estimated = [row for row in rows if row["estimate"] is not None]
    if estimated:
        body += ["", "Estimates: batch-1 decode and a context-long prefill, [low, high] tokens/s, uniform routing (hit "
                 "rate = cache / experts); the assumptions (jmoe/plan/estimate.py), for the first such row:", "",
                 *[f"- {line}" for line in estimated[0]["estimate"]["assumptions"]]]
    if not args.smoke:
        body += ["", "Published numbers of other engines for these models (gathered from the sources named, not "
                 "measured here; bench/helpers/plan_peers.py has each one's quote). kTransformers and llama.cpp "
                 "compute the offloaded experts on the host CPU, where jmoe copies them to the GPU, so their speed "
                 "depends on the host's CPUs and memory channels as much as on the card:", "", published(rows)]
    if errors:
        body += ["", "Failed plans:", *[f"- {e}" for e in errors]]
    (args.workdir / "plan_rows.json").write_text(json.dumps(rows))
    print(write_result("plan.md", "jmoe.plan on published MoE shapes", "\n".join(body) + "\n"))


if __name__ == "__main__":
    sys.exit(main())
