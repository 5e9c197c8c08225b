"""History prefetch in the engine against the replay (issues 15, 33): the stall-free rate and the experts copied
by the engine running the replay's recommended prefetch (`jmoe.load(..., prefetch_trace=...)`) on a
GPT-OSS-20B-shaped model whose routing is forced from the GPT-OSS-20B trace, next to the replay of the same
tokens, at 8 of 32 slots; and the engine's router prefetch (`prefetch=2`), which has no replay.

    python -m bench.engine_replay [--tokens 400] [--cache 8]
    python -m bench.engine_replay --smoke     # 2 MoE layers (the trace's first two), 8 tokens, no result file

The predictor is fitted on the trace's tuning split; the tokens are the first --tokens of its report
split, fed one per step (a one-token prompt, then decode steps), in the engine and in the replay alike.
Stall-free = accesses whose expert was in a device slot when its layer started.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jmoe
from bench.helpers.common import (add_smoke_argument, smoke_run, smoke_spec, write_random_checkpoint, write_result,
                                  write_smoke_checkpoint)
from jmoe.decode.sampling import SamplingParams
from jmoe.offload.history_prefetch import BEST, best_predictor
from jmoe.offload.policies import make_policy
from jmoe.traces.forced_routing import TraceRouting
from jmoe.traces.load import load_trace, split_trace
from jmoe.traces.replay import replay

# GPT-OSS-20B's MoE shape (24 layers, 32 experts, top-4) at tiny widths: routing is forced, so only the
# shape of the expert cache matters here, not the arithmetic.
ROUTER_PREFETCH = 2  # experts per layer and step, as the H100 programs are checked with (tests/test_plan_gpu_compile.py)
TINY_GPTOSS = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=24, num_attention_heads=4,
                   num_key_value_heads=2, num_local_experts=32, num_experts_per_tok=4, vocab_size=256,
                   max_position_embeddings=4096, eos_token_id=None)


def engine_rate(directory: Path, rows, cache: int, **options) -> tuple[float, int]:
    model = jmoe.load(directory, cache=cache, policy="lfru", progress=False, **options)
    routing = TraceRouting(rows, prompt_len=1, config=model.config)
    model.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing)
    stats = model.stats()
    hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
    return hits / (hits + misses), sum(s["bytes_moved"] for s in stats) // model.placement_plan.expert_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--cache", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_engine_replay"))
    add_smoke_argument(parser)
    args = parser.parse_args()
    with smoke_run(args):
        if args.smoke:
            args.tokens = 8
        compare(args)
    return 0


def compare(args) -> None:
    """The engine and the replay with and without history prefetch; the report."""
    began = time.perf_counter()
    load_before = open("/proc/loadavg").read().split()[:3]
    spec = smoke_spec(TINY_GPTOSS) if args.smoke else TINY_GPTOSS
    write = write_smoke_checkpoint if args.smoke else write_random_checkpoint  # a smoke run: no PyTorch to import
    directory = write(args.workdir / "gptoss_tiny", "mixtral", **spec)
    trace = load_trace("gptoss")
    if args.smoke:  # the smoke checkpoint has two MoE layers: the trace's first two drive them
        trace["expert_ids"] = trace["expert_ids"][:, :spec["num_hidden_layers"]]
    split = split_trace(trace, None)
    rows = split["eval_ids"][:args.tokens]
    layers, experts = rows.shape[1], trace["num_experts"]
    predictor = best_predictor(split["tune_ids"], experts)
    lines = ["| prefetch | engine stall-free | replay stall-free | difference (points) | engine experts copied "
             "| replay experts copied |", "|---|---|---|---|---|---|"]
    for label, options in (("none (demand only)", {}), ("best (history)", {"prefetch_trace": split["tune_ids"]})):
        rate, copied = engine_rate(directory, rows, args.cache, **options)
        replayed = replay(rows, experts, args.cache, make_policy("lfru", layers, experts),
                          predictor=predictor if options else None,
                          prefetch_budget=BEST["budget"] if options else 0,
                          prefetch_min_gain=BEST["min_gain"] if options else 0.0)
        lines.append(f"| {label} | {rate:.4f} | {replayed['stall_free_rate']:.4f} | "
                     f"{100 * (rate - replayed['stall_free_rate']):+.2f} | {copied} "
                     f"({copied / replayed['bytes_moved']:.3f}x) | {replayed['bytes_moved']} |")
        print(lines[-1], flush=True)
    router_rate, router_copied = engine_rate(directory, rows, args.cache, prefetch=ROUTER_PREFETCH)
    lines += ["", "| prefetch | engine stall-free | engine experts copied | of which prefetched | prefetch copies "
              "at 2 per layer after the first and decode step |", "|---|---|---|---|---|",
              f"| router (`prefetch={ROUTER_PREFETCH}`) | {router_rate:.4f} | {router_copied} | "
              f"{router_copied - round((1 - router_rate) * rows.size)} | "
              f"{ROUTER_PREFETCH * (layers - 1) * (len(rows) - 1)} |"]
    print(lines[-1], flush=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    body = (f"GPT-OSS-20B trace, report split `{split['eval_desc']}`, first {args.tokens} tokens; predictor fitted "
            f"on `{split['tune_desc']}`; cache {args.cache} of {experts} slots per layer, lfru; the `best` setting "
            f"{BEST}. Load average {' '.join(load_before)} before, {' '.join(load_after)} after (rates do not "
            f"depend on load); {time.perf_counter() - began:.0f} s.\n\n" + "\n".join(lines) + "\n\n"
            "Experts copied: every copy the step makes, in experts (`stats()`'s bytes moved over the expert's "
            "bytes); the engine copies only the prefetches the rule takes (on CPU a loop per layer whose trip count "
            "is their number, on a GPU the expert-copy kernel whose unwanted entries move nothing), the replay "
            "counts the copies it makes. Before issue 33 the engine made a static "
            "4 copies per layer and token for history prefetch (the unwanted ones dropped writes that still moved "
            "their bytes): 43958 experts against the replay's 20876.\n\n"
            "Router prefetch has no replay: its guess is layer l + 1's router applied to layer l's hidden state, "
            "and the trace holds expert ids only (jmoe.traces.replay's predictors score from ids; "
            "jmoe.traces.router_guess needs a real model's activations). Here the routing is forced from the "
            "trace onto a random-weight model, so the guess is unrelated to the routing and its stall-free rate "
            "says nothing about router prefetch on GPT-OSS; the table shows what it copies: demand copies (one "
            "per miss: batch 1, distinct experts) plus its fixed 2 copies per layer after the first and decode "
            "step, all wanted, since at 8 of 32 slots 24 experts are uncached and lfru offers 8 victims (the "
            "prompt step streams and prefetches nothing).\n")
    print(write_result("engine_replay.md", "History prefetch: engine against replay", body))


if __name__ == "__main__":
    raise SystemExit(main())
