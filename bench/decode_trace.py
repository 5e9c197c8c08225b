"""Decode throughput against cache size and policy, with real routing (issue 6).

  python -m bench.decode_trace                  # both parts -> bench/results/decode_trace_cpu.md
  python -m bench.decode_trace --part gptoss    # one part only -> bench/results/decode_trace_gptoss_cpu.md
  python -m bench.decode_trace --smoke          # every part at toy size (one MoE layer, one cache), no result

Part "default": the shipped model in checkpoints/default with its own router, a code prompt.
Part "gptoss": a GPT-OSS-20B-shaped random `gpt_oss` checkpoint (24 MoE layers, 32 experts, top-4, hidden and
expert width scaled down) whose expert choice is forced from the held-out split of the vendored GPT-OSS-20B
trace (bench/data), next to the same checkpoint in transformers (resident, its own routing).
Part "deepseek": a DeepSeek-V3-shaped random `deepseek_v3` checkpoint (MLA, 256 experts, top-8 in 8 groups, a
shared expert; 26 MoE layers after one dense one, as many as the trace has) driven by the Kimi-Linear-48B
trace's held-out half, next to transformers the same way.

Every (cache, policy) run starts from an empty cache and generates twice: an unmeasured generation (the
prompt step and --tokens / --default-tokens decode steps: it compiles the step shapes, since the KV-cache
length depends on the number of new tokens, and warms the cache), then the same length again, measured.
Hit rate and bytes moved count the measured decode steps only (statistics snapshot after its prompt
step). Bound per step = max(resident step time, bytes moved per step / measured host-to-slot copy
bandwidth). Compiled programs are kept in --workdir/jax_cache for the next run.

A smoke run: every part, each model at smoke size (bench.helpers.common.SMOKE_SIZES, one MoE layer, the trace cut
to it; the default model's first two layers, bench.helpers.common.default_model), 2 decode steps (4 for the default
model, 2 for transformers, timed once), one offloaded cache per part (the traced parts also their all-resident row) and one
policy per part (SMOKE_POLICY: each policy runs once).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import numpy as np

from bench.decode import PROMPT, copy_bandwidth_gbs, jmoe_decode, transformers_decode
from bench.helpers.common import (DEFAULT_MODEL, add_smoke_argument, default_model, run_parts, smoke_run, smoke_spec,
                                  write_random_checkpoint, write_result)

import jmoe
from jmoe.offload.policies import make_policy
from jmoe.decode.sampling import SamplingParams
from jmoe.traces.forced_routing import TraceRouting
from jmoe.traces.load import frequency_table, load_trace, split_trace
from jmoe.traces.replay import replay

POLICIES = ("lru", "lfru", "static")
SMOKE_POLICY = {"default": "lru", "gptoss": "lfru", "deepseek": "static"}  # a smoke run's one policy per part


def policies(args, part: str) -> tuple[str, ...]:
    return (SMOKE_POLICY[part],) if args.smoke else POLICIES
# GPT-OSS-20B: hidden 2880, expert width 2880, 64 query / 8 KV heads of 64, vocab 201k, windows of 128 in
# alternate layers. Scaled down so that a float32 copy (2.4 GB of experts) and its transformers twin fit this
# machine and a run takes seconds.
GPTOSS_SHAPED = dict(model_type="gpt_oss", hidden_size=512, intermediate_size=512, num_hidden_layers=24,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=32,
                     num_experts_per_tok=4, sliding_window=128, vocab_size=8192, max_position_embeddings=2048,
                     eos_token_id=None)
# DeepSeek-V3: hidden 7168, 256 experts of width 2048 in 8 groups (top-4 groups), top-8, 1 shared expert, MLA
# (q_lora 1536, kv_lora 512, heads of 128 + 64 rope, values 128), 3 dense layers. Scaled down (1.3 GB of float32
# experts); one dense layer and 26 MoE layers, as many as the Kimi-Linear trace records.
DEEPSEEK_SHAPED = dict(model_type="deepseek_v3", hidden_size=256, moe_intermediate_size=64, intermediate_size=512,
                       num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=256, num_experts_per_tok=8,
                       n_group=8, topk_group=4, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4,
                       q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                       routed_scaling_factor=2.5, vocab_size=8192, max_position_embeddings=2048, eos_token_id=None)
# Per traced part: checkpoint, trace, caches, and what the model stands for.
TRACED = {
    "gptoss": dict(config=GPTOSS_SHAPED, trace="gptoss", caches=(4, 8, 16, 32), title="GPT-OSS-20B",
                   trace_rows="the held-out GPT-OSS-20B trace rows (datasets not starting with mmlu, file order, "
                              "from the first row)", static="expert counts over the mmlu* rows"),
    "deepseek": dict(config=DEEPSEEK_SHAPED, trace="kimi", caches=(16, 64, 128, 256), title="DeepSeek-V3",
                     trace_rows="the Kimi-Linear-48B trace's second half (its 256 experts, top-8, 26 MoE layers; "
                                "the trace knows no expert groups, so forced choices may span any groups)",
                     static="expert counts over the trace's first half"),
}
DEFAULT_PROMPT = "import os\n\n\nclass Cache:\n    def get(self, key, default=None):\n        return self._data.get("


class Run:
    """One measured generation: decode tokens/s, step time, and the decode steps' cache statistics."""

    def __init__(self, result, first: list[dict], last: list[dict]):
        self.steps = result.decode_steps
        self.tps = result.decode_steps / result.decode_seconds
        self.step_s = result.decode_seconds / result.decode_steps
        hits = sum(b["hits"] - a["hits"] for a, b in zip(first, last))
        misses = sum(b["misses"] - a["misses"] for a, b in zip(first, last))
        self.hit_rate = hits / (hits + misses) if hits + misses else None
        self.moved_per_step = sum(b["bytes_moved"] - a["bytes_moved"] for a, b in zip(first, last)) / self.steps


def measure(model, prompts: list[list[int]], tokens: int, routing=None) -> Run:
    """The prompt step and `tokens` decode steps for every row; statistics of the decode steps only."""
    after_prompt = []

    def snapshot(_):  # called after every step; the first call follows the prompt step
        if not after_prompt:
            after_prompt.append(model.stats())

    result = model.generate_detailed(prompts, tokens + 1, SamplingParams(), on_tokens=snapshot,
                                     routing_override=routing)
    return Run(result, after_prompt[0], model.stats())


def bound_cells(run: Run, resident_step: float, bandwidth_gbs: float) -> str:
    bound = max(resident_step, run.moved_per_step / (bandwidth_gbs * 1e9))
    return f"{bound * 1e3:.1f} | {bound / run.step_s:.2f}"


def row(label: str, run: Run, resident_step: float, bandwidth_gbs: float, extra: str = "") -> str:
    hit = "-" if run.hit_rate is None else f"{run.hit_rate:.1%}"
    return (f"| {label} | {run.tps:.2f} | {run.step_s * 1e3:.1f} | {run.moved_per_step / 1e6:.1f} | "
            f"{bound_cells(run, resident_step, bandwidth_gbs)} | {hit} |{extra}")


TABLE_HEAD = ("| cache | policy | tok/s | ms/step | MB moved/step | bound ms/step | achieved / bound | hit rate |")


def replay_hits(rows: np.ndarray, measured: int, experts: int, cache: int, policy_factory) -> float:
    """Hit rate the replay gives the last `measured` rows of `rows`, every row replayed as a decode token."""
    def hits(ids):
        return replay(ids, experts, cache, policy_factory())["hits"]

    return (hits(rows) - hits(rows[:-measured])) / (measured * rows.shape[1] * rows.shape[2])


def traced_checkpoint(args, name: str, directory: Path) -> tuple[Path, dict]:
    """The checkpoint of TRACED[name] written to `directory` and its trace. In a smoke run: the checkpoint at
    smoke size with one MoE layer (each layer compiles and traces its own code), and the trace cut
    to it."""
    spec = TRACED[name]["config"]
    if args.smoke:
        spec = smoke_spec(spec, num_hidden_layers=spec.get("first_k_dense_replace", 0) + 1)
    directory = write_random_checkpoint(directory, **spec)
    trace = load_trace(TRACED[name]["trace"])
    if args.smoke:
        trace["expert_ids"] = trace["expert_ids"][:, :jmoe.load_config(directory).num_moe_layers]
    return directory, trace


def part_traced(args, log, name: str) -> str:
    spec = TRACED[name]
    directory, trace = traced_checkpoint(args, name, args.workdir / f"{name}_shaped")
    split = split_trace(trace)
    heldout, table = split["eval_ids"], frequency_table(split["tune_ids"], trace["num_experts"])
    layers, experts = heldout.shape[1], trace["num_experts"]
    p, n = len(PROMPT), args.tokens
    # Rows in the order the engine sees them: warm prompt, warm decode, measured prompt, measured decode.
    warm_rows = heldout[:p + n]
    measured_rows = heldout[p + n:2 * (p + n)]
    seen = np.concatenate([warm_rows, measured_rows])
    factories = {"lru": lambda: make_policy("lru", layers, experts),
                 "lfru": lambda: make_policy("lfru", layers, experts),
                 "static": lambda: make_policy("static", layers, experts, frequency=table)}

    resident = jmoe.load(directory, progress=False)
    cfg = resident.config
    params = sum(resident.placement_plan.nbytes.values()) // 4
    own_tps, _ = jmoe_decode(resident, n)
    measure(resident, [PROMPT], n, TraceRouting(warm_rows, p, cfg))  # compile with forced routing
    base = measure(resident, [PROMPT], n, TraceRouting(measured_rows, p, cfg))
    log(f"resident: own routing {own_tps:.2f} tok/s, forced {base.tps:.2f} tok/s")
    del resident
    hf_tps = transformers_decode(directory, args.hf_tokens, args.smoke)
    log(f"transformers: {hf_tps:.2f} tok/s")

    bandwidth = None
    rows = []
    for cache in (spec["caches"][0], spec["caches"][-1]) if args.smoke else spec["caches"]:
        if cache >= experts:
            rows.append(f"| {cache} (all resident) | - | {base.tps:.2f} | {base.step_s * 1e3:.1f} | 0.0 | "
                        f"{base.step_s * 1e3:.1f} | 1.00 | 100% | 100% |")
            continue
        model = jmoe.load(directory, cache=cache, progress=False)
        bandwidth = bandwidth or copy_bandwidth_gbs(model)
        for policy in policies(args, name):
            model.set_policy(factories[policy]())
            measure(model, [PROMPT], n, TraceRouting(warm_rows, p, cfg))
            run = measure(model, [PROMPT], n, TraceRouting(measured_rows, p, cfg))
            expected = replay_hits(seen, n, experts, cache, factories[policy])
            rows.append(row(f"{cache} | {policy}", run, base.step_s, bandwidth, f" {expected:.1%} |"))
            log(rows[-1])
        del model
    return (
        f"## {spec['title']}-shaped random `{cfg.family}` model, routing forced from a trace\n\n"
        f"{cfg.num_layers} layers ({cfg.num_moe_layers} MoE), {experts} experts, top-{cfg.num_experts_per_tok}, "
        f"hidden {cfg.hidden_size}, expert width {cfg.expert_intermediate_size}, {cfg.num_heads} query heads, "
        f"vocab {cfg.vocab_size}: {params / 1e6:.0f}M parameters, float32, one expert = "
        f"{model_expert_mb(cfg):.2f} MB, random weights written by transformers (`{name}` in `TRACED` of this "
        f"script has every setting).\n\n"
        f"Routing: every MoE layer's expert ids are forced from {spec['trace_rows']}: the {p}-token prompt takes one "
        f"row per token, each decode step the next row. Per (cache, policy): empty cache, an unmeasured "
        f"generation (prompt + {n} decode steps, rows 0-{len(warm_rows) - 1}) that compiles and warms the cache, "
        f"then the measured one: prompt + {n} decode steps, rows {len(warm_rows)}-{len(seen) - 1}. Static's table: "
        f"{spec['static']}. Batch 1, greedy.\n\n"
        f"Bound per step = max(resident step time under the same forced routing ({base.step_s * 1e3:.1f} ms), "
        f"bytes moved per step / host-to-slot copy bandwidth ({bandwidth:.2f} GB/s, measured like "
        f"`bench/decode.py::copy_bandwidth_gbs`)). Hit rate: the engine's statistics over the measured decode "
        f"steps. Replay hit rate: `bench/replay.py`'s replay of the same row sequence (every row as a decode "
        f"token, so prompt rows are admitted where the engine streams them) over the same decode rows.\n\n"
        f"{TABLE_HEAD} replay hit rate |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Same checkpoint, every expert resident, each engine with its own (random-weight) router, after a "
        f"{p}-token prompt: jmoe over {n} decode steps, transformers over {args.hf_tokens} (decode time = "
        f"generate({args.hf_tokens} + 1 tokens) - generate(1 token), medians, as `bench/decode.py compare`):\n\n"
        f"| engine | tok/s |\n|---|---|\n| jmoe | {own_tps:.2f} |\n"
        f"| transformers {__import__('transformers').__version__} (PyTorch {__import__('torch').__version__}, "
        f"{__import__('torch').get_num_threads()} threads) | {hf_tps:.2f} |\n"
        f"| jmoe, routing forced from the trace | {base.tps:.2f} |\n"
    )


def model_expert_mb(cfg) -> float:
    return 3 * cfg.hidden_size * cfg.expert_intermediate_size * 4 / 1e6


def part_default(args, log) -> str:
    if not (DEFAULT_MODEL / "config.json").is_file():
        log(f"{DEFAULT_MODEL} not found: part (a) skipped")
        return "## (a) Default model\n\nNot measured: `checkpoints/default` was not present when this ran.\n"
    directory = default_model(args)
    resident = jmoe.load(directory, progress=False)
    cfg = resident.config
    prompt = resident.require_tokenizer().encode(DEFAULT_PROMPT)
    e, k, n = cfg.num_experts, cfg.num_experts_per_tok, args.default_tokens
    measure(resident, [prompt], n)  # compile
    base = measure(resident, [prompt], n)
    log(f"default resident: {base.tps:.2f} tok/s over {base.steps} steps")
    del resident
    caches = [k] if args.smoke else sorted({k, e // 4, e // 2})
    bandwidth = None
    rows = []
    steps = {base.steps}
    for cache in caches:
        model = jmoe.load(directory, cache=cache, progress=False)
        bandwidth = bandwidth or copy_bandwidth_gbs(model)
        for name in policies(args, "default"):
            model.set_policy(name)
            measure(model, [prompt], n)
            run = measure(model, [prompt], n)
            steps.add(run.steps)
            rows.append(row(f"{cache} | {name}", run, base.step_s, bandwidth))
            log(rows[-1])
        del model
    rows.append(f"| {e} (all resident) | - | {base.tps:.2f} | {base.step_s * 1e3:.1f} | 0.0 | "
                f"{base.step_s * 1e3:.1f} | 1.00 | 100% |")
    return (
        f"## (a) Default model (`checkpoints/default`), its own routing\n\n"
        f"`{cfg.family}`, {cfg.num_layers} layers ({cfg.num_moe_layers} MoE), {e} experts, top-{k}, hidden "
        f"{cfg.hidden_size}, expert width {cfg.expert_intermediate_size}, dtype {cfg.dtype}. Prompt: a "
        f"{len(prompt)}-token Python snippet; greedy; per (cache, policy): empty cache, an unmeasured "
        f"generation of up to {n} decode steps (compiles, warms the cache), then the same again, measured "
        f"(decode steps actually run, a stop at EOS included: {sorted(steps)}). Static pins the experts the "
        f"first step (the warm-up prompt) used most (the engine's `policy=\"static\"`). Bound as in the traced parts, resident step "
        f"{base.step_s * 1e3:.1f} ms, copy bandwidth {bandwidth:.2f} GB/s measured on this model's experts.\n\n"
        f"{TABLE_HEAD}\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "default", *TRACED], default="all")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench"))
    parser.add_argument("--tokens", type=int, default=24,
                        help="GPT-OSS-shaped model: decode steps per run (measured, and again to warm up)")
    parser.add_argument("--default-tokens", type=int, default=128,
                        help="default model: decode steps per run (its steps take milliseconds)")
    parser.add_argument("--hf-tokens", type=int, default=8, help="decode tokens per transformers run (slow on CPU)")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    with smoke_run(args):
        if args.smoke:
            args.tokens, args.default_tokens, args.hf_tokens = 2, 4, 2
        write_report(args)


def write_report(args) -> None:
    args.workdir.mkdir(parents=True, exist_ok=True)
    # Each cache size compiles its own programs (about a minute each here); keep them for the next run.
    jax.config.update("jax_compilation_cache_dir", str(args.workdir / "jax_cache"))
    parts = {"default": part_default, **{name: functools.partial(part_traced, name=name) for name in TRACED}}
    sections, conditions = run_parts(args, parts)
    body = (f"Batch-1 greedy decode on CPU (JAX's 'device' and 'pinned_host' memory are both host RAM here, so "
            f"a host-to-slot copy is a memcpy). The machine is shared with other jobs: {conditions}. Single "
            f"runs, no repeats: read differences under ~10% as noise.\n\n" + "\n".join(sections))
    name = "decode_trace_cpu.md" if args.part == "all" else f"decode_trace_{args.part}_cpu.md"
    print(write_result(name, "Decode throughput with real routing (CPU)", body))


if __name__ == "__main__":
    main()
