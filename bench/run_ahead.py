"""Steps dispatched ahead of the host's bookkeeping (issue #54 item 3): decode speed and stall-free rate with each
step dispatched before the last one is read back (`run_ahead=True`, generate's default) and with each read back
first (`run_ahead=False`), side by side in one process.

  python -m bench.run_ahead              # -> bench/results/run_ahead_cpu.md
  python -m bench.run_ahead --smoke      # toy sizes, one round, one setting per part, no result file

Part "speed": the shipped model (checkpoints/default), batch 1, its own router, LFRU at cache 4 of 16 in miss modes
"fetch" and "host", and every expert resident. Each setting loads once and generates once unmeasured (compiles,
warms the cache); then the rounds alternate the two ways, each a fresh cache (`set_policy`) and one generation of
--tokens; medians over the rounds. Device ms/step: one more generation with each program waited for as it is
dispatched (bench.gpu.profile.step_timer); host ms/step: the waiting step less that, everything between two steps
(the read back, the manager's `after_step`, timed apart, and the generation loop); the bound of a step run ahead is
the larger of the two (the host's work beside the device's instead of after it). On this CPU the "device" is
XLA:CPU on the same two cores as the host's Python, so the two compete where a GPU's would not.
Part "serve": the serving engine (`ServingEngine(run_ahead=...)`, stepped by hand) decoding four plain greedy requests
of --tokens together, the same settings, a first round that compiles, then --rounds alternated.
Part "policy": what tables a step old cost the cache: bench.engine_replay's GPT-OSS-20B-shaped model, its routing
forced from the held-out GPT-OSS-20B trace (--trace-tokens tokens), cache 8 of 32, LFRU, next to the replay.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jmoe
from bench.decode_trace import DEFAULT_PROMPT
from bench.engine_replay import TINY_GPTOSS
from bench.gpu.profile import step_timer
from bench.helpers.common import (add_smoke_argument, default_model, run_parts, smoke_run, smoke_spec,
                                  write_random_checkpoint, write_result, write_smoke_checkpoint)
from jmoe.decode.sampling import SamplingParams
from jmoe.offload.policies import make_policy
from jmoe.serve import RequestParams, ServingEngine
from jmoe.traces.forced_routing import TraceRouting
from jmoe.traces.load import load_trace, split_trace
from jmoe.traces.replay import replay

WAYS = {"ahead": True, "waiting": False}
SERVE_ROWS = 4
SERVE_PROMPTS = ["def parse(text):\n", "class Stack:\n    def push(self, item):\n", "import sys\n\n\ndef main(",
                 "for i in range(10):\n    "]
SPEED_SETTINGS = {"resident": {}, "cache 4, fetch": dict(cache=4), "cache 4, host": dict(cache=4, miss_mode="host")}
SMOKE_SPEED_SETTING = "cache 4, fetch"  # a smoke run's one setting per part (each load compiles its programs)
POLICY_CACHE = 8
MISS_MODES = ("fetch", "host")


def timed_after_step(engine) -> list[float]:
    """The seconds each later call of `engine.after_step` takes, appended to the returned list."""
    seconds, inner = [], engine.after_step

    def after_step(*args):
        began = time.perf_counter()
        inner(*args)
        seconds.append(time.perf_counter() - began)

    engine.after_step = after_step
    return seconds


def stall_free(stats_before: list[dict], stats_after: list[dict]) -> float | None:
    hits = sum(a["hits"] - b["hits"] for a, b in zip(stats_after, stats_before))
    misses = sum(a["misses"] - b["misses"] for a, b in zip(stats_after, stats_before))
    return hits / (hits + misses) if hits + misses else None


def default_models(args):
    """(label, options, the default model loaded with them) for each of SPEED_SETTINGS (a smoke run's one), each
    closed once the caller has measured it."""
    directory = default_model(args)
    for label, options in SPEED_SETTINGS.items():
        if args.smoke and label != SMOKE_SPEED_SETTING:
            continue
        model = jmoe.load(directory, progress=False, **options)
        try:
            yield label, options, model
        finally:
            model.close()


def part_speed(args, log) -> str:
    lines = ["| setting | tok/s waiting | tok/s ahead | ahead / waiting | device ms/step | host ms/step | of it the "
             "manager's | bound ms/step | ahead's share of the bound | stall-free waiting | stall-free ahead |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, options, model in default_models(args):
        prompt = [model.require_tokenizer().encode(DEFAULT_PROMPT)]
        manager_seconds = timed_after_step(model.engine)
        for run_ahead in WAYS.values():  # compiles both ways' programs (the same ones) and warms up
            model.generate_detailed(prompt, args.tokens, SamplingParams(), run_ahead=run_ahead)
        samples = {way: {"step": [], "manager": [], "stall_free": []} for way in WAYS}
        for _ in range(args.rounds):
            for way, run_ahead in WAYS.items():
                if options:  # an empty cache for each run
                    model.set_policy("lfru")
                before, manager_seconds[:] = model.stats(), []
                result = model.generate_detailed(prompt, args.tokens, SamplingParams(), run_ahead=run_ahead)
                samples[way]["step"].append(result.decode_seconds / result.decode_steps)
                samples[way]["manager"].append(statistics.mean(manager_seconds[1:]))  # decode steps only
                samples[way]["stall_free"].append(stall_free(before, model.stats()) if options else None)
        with step_timer(model) as times:  # each program waited for as it is dispatched: the device's own time
            model.generate_detailed(prompt, args.tokens, SamplingParams(), run_ahead=False)
        device = statistics.median(times["step"][1:])
        step = {way: statistics.median(samples[way]["step"]) for way in WAYS}
        host = step["waiting"] - device  # everything between two steps: the read, the manager, the loop
        bound = max(device, host)  # the host's work beside the device's, not after it
        rates = ["-" if options == {} else f"{statistics.median(samples[way]['stall_free']):.3f}" for way in WAYS]
        lines.append(f"| {label} | {1 / step['waiting']:.1f} | {1 / step['ahead']:.1f} | "
                     f"{step['waiting'] / step['ahead']:.2f}x | {device * 1e3:.2f} | {host * 1e3:.2f} | "
                     f"{statistics.median(samples['waiting']['manager']) * 1e3:.2f} | {bound * 1e3:.2f} | "
                     f"{bound / step['ahead']:.0%} | {rates[1]} | {rates[0]} |")
        log(lines[-1])
    return (f"## Speed: the default model, batch 1, {args.tokens} new tokens, medians of {args.rounds} alternated "
            f"rounds\n\n" + "\n".join(lines) + "\n")


def part_serve(args, log) -> str:
    """The serving engine: SERVE_ROWS plain greedy requests of --tokens decoded together, stepped by hand until done."""
    lines = ["| setting | tok/s waiting | tok/s ahead | ahead / waiting |", "|---|---|---|---|"]
    for label, options, model in default_models(args):
        prompts = [model.require_tokenizer().encode(text) for text in SERVE_PROMPTS]
        engines = {way: ServingEngine(model, max_batch=SERVE_ROWS, context=args.tokens + 64, run_ahead=run_ahead)
                   for way, run_ahead in WAYS.items()}
        seconds = {way: [] for way in WAYS}
        for round_ in range(args.rounds + 1):  # the first round compiles and is not counted
            for way, engine in engines.items():
                if options:
                    model.set_policy("lfru")
                requests = [engine.submit(ids, RequestParams(max_tokens=args.tokens, temperature=0.0))
                            for ids in prompts]
                began = time.perf_counter()
                while not all(r.done for r in requests):
                    engine.step()
                if round_:
                    seconds[way].append(time.perf_counter() - began)
        rate = {way: SERVE_ROWS * args.tokens / statistics.median(seconds[way]) for way in WAYS}
        lines.append(f"| {label} | {rate['waiting']:.1f} | {rate['ahead']:.1f} | "
                     f"{rate['ahead'] / rate['waiting']:.2f}x |")
        log(lines[-1])
    return (f"## Serving engine: {SERVE_ROWS} plain greedy requests of {args.tokens} tokens together (prompts "
            f"included in the time), medians of {args.rounds} alternated rounds\n\n" + "\n".join(lines) + "\n")


def part_policy(args, log) -> str:
    spec = smoke_spec(TINY_GPTOSS) if args.smoke else TINY_GPTOSS
    write = write_smoke_checkpoint if args.smoke else write_random_checkpoint  # a smoke run: no PyTorch to import
    directory = write(args.workdir / "gptoss_tiny", "mixtral", **spec)
    trace = load_trace("gptoss")
    trace["expert_ids"] = trace["expert_ids"][:, :spec["num_hidden_layers"]]
    rows = split_trace(trace, None)["eval_ids"][:args.trace_tokens]
    layers, experts = rows.shape[1], trace["num_experts"]
    replayed = replay(rows, experts, POLICY_CACHE, make_policy("lfru", layers, experts))["stall_free_rate"]
    lines = ["| miss mode | way | stall-free | replay (tables always current) |", "|---|---|---|---|"]
    for mode in MISS_MODES[-1:] if args.smoke else MISS_MODES:
        model = jmoe.load(directory, cache=POLICY_CACHE, policy="lfru", miss_mode=mode, progress=False)
        for way, run_ahead in WAYS.items():
            model.set_policy("lfru")
            before, routing = model.stats(), TraceRouting(rows, prompt_len=1, config=model.config)
            model.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing,
                                    run_ahead=run_ahead)
            lines.append(f"| {mode} | {way} | {stall_free(before, model.stats()):.4f} | {replayed:.4f} |")
            log(lines[-1])
    return (f"## Policy: GPT-OSS-20B trace, {len(rows)} tokens, {layers} MoE layers, cache {POLICY_CACHE} of "
            f"{experts}, LFRU\n\n" + "\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "speed", "serve", "policy"), default="all")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per measured generation")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--trace-tokens", type=int, default=400)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_run_ahead"))
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    with smoke_run(args):
        if args.smoke:
            args.tokens, args.rounds, args.trace_tokens = 4, 1, 8
        sections, conditions = run_parts(args, {"speed": part_speed, "serve": part_serve, "policy": part_policy})
        print(write_result("run_ahead_cpu.md", "Steps dispatched ahead of the host's bookkeeping",
                           f"{__doc__.split(chr(10) + chr(10), 1)[1]}\n{conditions}.\n\n" + "\n".join(sections)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
