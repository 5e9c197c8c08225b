"""Decode throughput with and without prefetch, in both miss modes, and with layer-group weight prefetch.

  python -m bench.decode_modes                 # both parts -> bench/results/decode_modes_cpu.md
  python -m bench.decode_modes --part default  # the default model only (a few minutes)
  python -m bench.decode_modes --smoke         # both parts at toy size (2 decode steps), no result file

Part "default": the shipped model (checkpoints/default) with its own router, batch 1 and batch 4
(four different code prompts), cache 4 of 16 experts per layer, LFRU.
Part "gptoss": the GPT-OSS-20B-shaped random model of bench/decode_trace.py, routing forced from the
held-out GPT-OSS-20B trace, batch 1, cache 8 of 32, LFRU.

Rows: every expert resident; then the offload engine with prefetch off / on (`prefetch=k`: the next
layer's router guess, up to k experts per layer) in miss mode "fetch" (a missed expert is copied to the
device) and "host" (computed on the host with compute_on("device_host")); then layer-group weight
prefetch (every second layer's non-expert weights on the host, fetched one layer ahead) on top of the
resident experts. Each row: a new load, an unmeasured generation (compiles, warms the cache), then the
same generation again, measured. "Stall-free" = the engine's hit rate over the measured decode steps:
accesses whose expert sat in a device slot when its layer started (a prefetched expert counts).
On this CPU JAX's device and pinned_host memory are both host RAM: a "copy" is a memcpy and "host
compute" runs on the same cores, so these numbers show the engine's overheads, not PCIe effects.
"""
# What a smoke run cuts (each setting compiles its own programs, most of a smoke run's time): 2 decode steps,
# the default model's first two layers (bench.helpers.common.default_model) at batch 4 only, the GPT-OSS-shaped
# model at smoke size with one MoE layer, and each setting once, split between the parts by SMOKE_SETTINGS (layer
# groups on the default model, which has the layers to group); the final resident repeat is left out.

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from bench.decode import PROMPT
from bench.decode_trace import DEFAULT_PROMPT, measure, traced_checkpoint
from bench.helpers.common import add_smoke_argument, default_model, run_parts, smoke_run, write_result

from jmoe.traces.forced_routing import TraceRouting
from jmoe.traces.load import split_trace


BATCH_PROMPTS = [DEFAULT_PROMPT, "def parse(text):\n    result = []\n    for line in text.splitlines():\n",
                 "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
                 "import sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"]
# A smoke run's rows per part: indices into settings().
SMOKE_SETTINGS = {"default": (1, 5), "gptoss": (0, 2, 3, 4)}
TABLE_HEAD = ("| setting | batch | tok/s (all rows) | ms/step | stall-free | MB moved/step |\n"
              "|---|---|---|---|---|---|")


def settings(k: int, cache: int) -> list[tuple[str, dict]]:
    """(label, jmoe.load options) per row."""
    return [("resident", {}),
            (f"cache {cache}, fetch", dict(cache=cache)),
            (f"cache {cache}, fetch, prefetch {k}", dict(cache=cache, prefetch=k)),
            (f"cache {cache}, host", dict(cache=cache, miss_mode="host")),
            (f"cache {cache}, host, prefetch {k}", dict(cache=cache, miss_mode="host", prefetch=k)),
            ("resident experts, layer groups G=2 N=1 K=1",
             dict(offload_group_size=2, offload_num_in_group=1, offload_prefetch_step=1)),
            ("resident (again, to show drift over the run)", {})]


def smoke_settings(chosen: list[tuple[str, dict]], part: str) -> list[tuple[str, dict]]:
    return [chosen[i] for i in SMOKE_SETTINGS[part]]


def run_rows(directory, batches: dict[int, list[list[int]]], tokens: int, log, chosen: list[tuple[str, dict]],
             routing=None) -> list[str]:
    import jmoe

    rows = []
    for label, kwargs in chosen:
        model = jmoe.load(directory, policy="lfru", progress=False, **kwargs)
        for batch, prompts in batches.items():
            if model.stats():
                model.set_policy("lfru")  # every measurement starts from an empty cache
            measure(model, prompts, tokens, routing and routing[0])  # compile, warm the cache
            run = measure(model, prompts, tokens, routing and routing[1])
            stall_free = "-" if run.hit_rate is None else f"{run.hit_rate:.1%}"
            rows.append(f"| {label} | {batch} | {run.tps * batch:.1f} | {run.step_s * 1e3:.1f} | {stall_free} | "
                        f"{run.moved_per_step / 1e6:.2f} |")
            log(rows[-1])
        model = None
    return rows


def part_default(args, log) -> str:
    import jmoe
    directory = default_model(args)
    tokenizer = jmoe.load(directory, progress=False).require_tokenizer()
    prompts = [tokenizer.encode(p) for p in BATCH_PROMPTS]
    cfg = jmoe.load_config(directory)
    chosen = settings(cfg.num_experts_per_tok, args.default_cache)
    batches, chosen = ({4: prompts}, smoke_settings(chosen, "default")) if args.smoke else \
        ({1: prompts[:1], 4: prompts}, chosen)
    rows = run_rows(directory, batches, args.default_tokens, log, chosen)
    return (f"## (a) Default model, its own routing\n\n`checkpoints/default` ({cfg.num_moe_layers} MoE layers, "
            f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, float32), greedy, {args.default_tokens} "
            f"decode steps after code prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
            f"batch 4 = four different prompts (left-padded). tok/s counts every row's tokens.\n\n"
            f"{TABLE_HEAD}\n" + "\n".join(rows) + "\n")


def part_gptoss(args, log) -> str:
    directory, trace = traced_checkpoint(args, "gptoss", args.workdir / "gptoss_shaped_mixtral")
    import jmoe

    cfg = jmoe.load_config(directory)
    heldout = split_trace(trace)["eval_ids"]
    p, n = len(PROMPT), args.tokens
    routing = (TraceRouting(heldout[:p + n], p, cfg), TraceRouting(heldout[p + n:2 * (p + n)], p, cfg))
    chosen = settings(cfg.num_experts_per_tok, args.gptoss_cache)
    rows = run_rows(directory, {1: [PROMPT]}, n, log, smoke_settings(chosen, "gptoss") if args.smoke else chosen,
                    routing)
    return (f"## (b) GPT-OSS-20B-shaped random model, routing forced from the GPT-OSS-20B trace\n\n"
            f"The model of `bench/decode_trace.py` ({cfg.num_layers} MoE layers, {cfg.num_experts} experts, "
            f"top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}, float32); expert ids forced from the "
            f"held-out trace rows (warm-up rows 0-{p + n - 1}, measured rows {p + n}-{2 * (p + n) - 1}); batch 1, "
            f"{n} decode steps. The prefetch guess uses the model's own (random) router, which is unrelated to "
            f"the forced routing, so it shows the cost of prefetching with a poor guess.\n\n"
            f"{TABLE_HEAD}\n" + "\n".join(rows) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "default", "gptoss"], default="all")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench"))
    parser.add_argument("--default-tokens", type=int, default=64)
    parser.add_argument("--default-cache", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16, help="GPT-OSS-shaped model: decode steps per run")
    parser.add_argument("--gptoss-cache", type=int, default=8)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    with smoke_run(args):
        if args.smoke:
            args.default_tokens, args.tokens = 2, 2
        write_report(args)


def write_report(args) -> None:
    args.workdir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(args.workdir / "jax_cache"))
    sections, conditions = run_parts(args, {"default": part_default, "gptoss": part_gptoss})
    body = (__doc__.split("\n\n", 2)[2] + f"\nRun conditions: {conditions}. Single runs: read "
            f"differences under ~10% as noise.\n\n" + "\n".join(sections))
    print(write_result(f"decode_modes_{jax.default_backend()}.md",
                       "Decode with prefetch, miss modes and layer groups", body))


if __name__ == "__main__":
    main()
