"""Decode throughput benchmarks (CPU here; the same script runs on a GPU).

  python -m bench.decode compare   # jmoe vs transformers, batch-1 decode, two random checkpoints (issue 2)
  python -m bench.decode cache     # tokens/s against cache size, next to the transfer bound (issue 3)
  python -m bench.decode manager   # manager time per decode step, 24 layers x 32 experts, top-4 (issue 3)
  python -m bench.decode --smoke   # all three at toy size (one mode: name it), no result file

Random-weight checkpoints are written once under --workdir (default /tmp/jmoe_bench) by transformers,
so both engines load the same files. Results go to bench/results/.

A smoke run: every mode, the models at smoke size (bench.helpers.common.SMOKE_SIZES), 4 new tokens; compare mode the
Mixtral model only (transformers timed once), cache mode cache top-k only (every model and cache runs the same code,
and each compiles its own programs); manager mode 20 steps.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bench.helpers.common import (add_smoke_argument, median_seconds, one_expert_bytes, read_bandwidth_gbs, smoke_run,
                                  smoke_spec, write_random_checkpoint, write_result)

COMPARE_MODELS = {
    # ~215M parameters: hidden 512, 8 layers, 16 experts, top-2, vocab 8192
    "mixtral": dict(model_type="mixtral", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2,
                    vocab_size=8192, max_position_embeddings=2048),
    # same, but 32 experts of width 512, top-4
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, vocab_size=8192,
                      max_position_embeddings=2048),
}
# Mixtral-shaped, ~400M parameters: memory traffic dominates a decode step.
CACHE_MODEL = dict(model_type="mixtral", hidden_size=768, intermediate_size=2688, num_hidden_layers=8,
                   num_attention_heads=12, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                   vocab_size=8192, max_position_embeddings=2048)
PROMPT = list(range(100, 132))
SMOKE_COMPARE_MODELS = ("mixtral",)  # a smoke run's compare mode
MODES = ("compare", "cache", "manager")


def compare_models(smoke: bool) -> dict:
    """COMPARE_MODELS, at smoke size for a smoke run."""
    return {name: smoke_spec(spec) for name, spec in COMPARE_MODELS.items()} if smoke else COMPARE_MODELS


class WeightReads(NamedTuple):
    """Weight bytes a decode step reads: `fixed` whatever its rows (every dense matrix, and the embedding when it is
    the LM head too), `per_row` per token (an embedding row, when it is not) and `per_expert` per expert of a MoE
    layer (each distinct expert once)."""

    fixed: int
    per_row: int
    per_expert: int
    moe_layers: int
    top_k: int

    def step(self, rows: float = 1, experts_per_layer: float | None = None) -> float:
        """Bytes of a step of `rows` tokens that reads `experts_per_layer` distinct experts in each MoE layer (top_k,
        as one row needs, by default)."""
        experts = self.top_k if experts_per_layer is None else experts_per_layer
        return self.fixed + rows * self.per_row + self.moe_layers * experts * self.per_expert


def weight_reads(model) -> WeightReads:
    placement, cfg = model.placement_plan, model.config
    dense = sum(b for k, b in placement.nbytes.items() if placement.groups[k] not in ("experts", "embedding"))
    embed = placement.nbytes["embed"]
    tied = cfg.tie_word_embeddings
    return WeightReads(dense + (embed if tied else 0), 0 if tied else embed // cfg.vocab_size, placement.expert_bytes,
                       cfg.num_moe_layers, cfg.num_experts_per_tok)


def jmoe_decode(model, new_tokens: int, run_ahead: bool = True) -> tuple[float, float]:
    """(decode tokens/s, seconds per step) at batch 1, greedy, after a warm-up run (run_ahead: Model.generate's)."""
    from jmoe.decode.sampling import SamplingParams

    # Warm up with the same length: the KV-cache length (and so the compiled step) depends on it.
    model.generate_detailed([PROMPT], new_tokens, SamplingParams(), run_ahead=run_ahead)
    result = model.generate_detailed([PROMPT], new_tokens, SamplingParams(), run_ahead=run_ahead)
    return result.decode_steps / result.decode_seconds, result.decode_seconds / result.decode_steps


def transformers_decode(directory: Path, new_tokens: int, smoke: bool = False) -> float:
    """transformers' decode tokens/s: generate(new_tokens + 1) - generate(1), medians of 2 and 3 timed runs after a
    warm-up each (a smoke run: one timed run each)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])

    def run(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    prefill = median_seconds(lambda: run(1), repeats=1 if smoke else 3)
    full = median_seconds(lambda: run(new_tokens + 1), repeats=1 if smoke else 2)
    return new_tokens / (full - prefill)


def cmd_compare(args) -> None:
    import jmoe

    bandwidth = read_bandwidth_gbs(args.smoke)
    rows = []
    for name, spec in compare_models(args.smoke).items():
        if args.smoke and name not in SMOKE_COMPARE_MODELS:
            continue
        directory = write_random_checkpoint(args.workdir / f"compare_{name}", **spec)
        model = jmoe.load(directory, progress=False)
        params = sum(model.placement_plan.nbytes.values()) // 4
        jmoe_tps, _ = jmoe_decode(model, args.tokens)
        hf_tps = transformers_decode(directory, args.tokens, args.smoke)
        per_token = weight_reads(model).step()
        bound = bandwidth * 1e9 / per_token
        rows.append(f"| {name} | {params / 1e6:.0f}M | {jmoe_tps:.1f} | {hf_tps:.1f} | {jmoe_tps / hf_tps:.2f}x | "
                    f"{per_token / 1e6:.1f} MB | {bound:.1f} | {jmoe_tps / bound:.0%} |")
        print(rows[-1], flush=True)
    body = (f"Batch-1 greedy decode of {args.tokens} tokens after a {len(PROMPT)}-token prompt, float32, "
            f"random weights, every expert resident. transformers {__import__('transformers').__version__} "
            f"(PyTorch {__import__('torch').__version__}, {__import__('torch').get_num_threads()} threads) "
            f"loads the same safetensors files. Bound = measured read bandwidth ({bandwidth:.1f} GB/s, "
            f"a jitted sum over 1 GiB) / bytes of weights one token reads (dense matrices + top-k experts "
            f"per layer + one embedding row).\n\n"
            "| model | params | jmoe tok/s | transformers tok/s | jmoe / transformers | bytes/token | "
            "bound tok/s | share of bound |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(write_result("decode_compare_cpu.md", "Decode throughput: jmoe vs transformers (CPU)", body))


def copy_bandwidth_gbs(model) -> float:
    """Host-to-slot copy bandwidth as the engine sees it: one expert's pinned-host weights (every leaf) into
    device buffers."""
    import jax

    from jmoe.offload.slots import device_copy

    host = model.module().moe_blocks()[0].experts.weights()
    copy = jax.jit(device_copy)
    seconds = median_seconds(lambda: jax.block_until_ready(copy(host, np.int32(1))), repeats=20)
    return one_expert_bytes(host.stacked()) / seconds / 1e9


def cmd_cache(args) -> None:
    import jmoe
    from jmoe.decode.sampling import SamplingParams

    directory = write_random_checkpoint(args.workdir / "cache_mixtral",
                                        **(smoke_spec(CACHE_MODEL) if args.smoke else CACHE_MODEL))
    resident = jmoe.load(directory, progress=False)
    cfg = resident.config
    params = sum(resident.placement_plan.nbytes.values()) // 4
    resident_tps, resident_step = jmoe_decode(resident, args.tokens)
    del resident
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    rows = [f"| resident | {resident_tps:.2f} | {resident_step * 1e3:.1f} | 0.0 | {resident_step * 1e3:.1f} | 1.00 | - |"]
    bandwidth = None
    for cache in sorted({k} if args.smoke else {0, k, e // 4, e // 2}):
        model = jmoe.load(directory, cache=cache, policy=args.policy, progress=False)
        bandwidth = bandwidth or copy_bandwidth_gbs(model)
        model.generate(PROMPT, max_new_tokens=args.tokens)  # compile this KV-cache length
        model.set_policy(args.policy)  # measure from an empty cache

        after_prefill = {}

        def snapshot(tokens):  # called after every step; the first call follows the prefill
            after_prefill.setdefault("stats", model.stats())

        result = model.generate_detailed([PROMPT], args.tokens, SamplingParams(), on_tokens=snapshot)
        tps = result.decode_steps / result.decode_seconds
        step = result.decode_seconds / result.decode_steps
        stats = model.stats()
        first = after_prefill["stats"]
        moved_per_step = (sum(s["bytes_moved"] for s in stats) - sum(s["bytes_moved"] for s in first)) / result.decode_steps
        hits = sum(s["hits"] for s in stats) - sum(s["hits"] for s in first)
        misses = sum(s["misses"] for s in stats) - sum(s["misses"] for s in first)
        bound_step = resident_step + moved_per_step / (bandwidth * 1e9)
        rows.append(f"| {cache} | {tps:.2f} | {step * 1e3:.1f} | {moved_per_step / 1e6:.1f} | {bound_step * 1e3:.1f} | "
                    f"{bound_step / step:.2f} | {hits / max(1, hits + misses):.1%} |")
        print(rows[-1], flush=True)
        model = None  # free this cache size's buffers before the next load
    body = (f"Mixtral-shaped random model, {params / 1e6:.0f}M parameters (hidden {cfg.hidden_size}, "
            f"{cfg.num_layers} layers, {e} experts of width {cfg.expert_intermediate_size}, top-{k}), float32, "
            f"batch 1, greedy, {args.tokens} new tokens after a {len(PROMPT)}-token prompt, policy {args.policy}. "
            f"Bound per step = resident step time + bytes moved per step / measured host-to-slot copy bandwidth "
            f"({bandwidth:.2f} GB/s, a jitted slice + device_put of one expert). On this CPU 'device' and "
            f"'pinned_host' are both host RAM, so a copy is a memcpy. MB moved and hit rate count decode steps "
            f"only (a random-weight model routes consecutive tokens much alike, so hit rates are high).\n\n"
            "| cache | tok/s | ms/step | MB moved/step | bound ms/step | achieved / bound | hit rate |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(write_result("decode_cache_cpu.md", "Decode throughput against cache size (CPU)", body))


def cmd_manager(args) -> None:
    from jmoe.offload.manager import SlotManager

    layers, experts, top_k, slots = 24, 32, 4, 8
    rng = np.random.default_rng(0)
    rows = []
    for policy in ("lru", "lfu", "lfru", "static"):
        manager = SlotManager(policy, experts, (slots,) * layers, expert_bytes=1)
        slot_of_expert = np.full((layers, experts), -1, np.int32)
        times = []
        for step in range(args.steps):
            routing = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])[:, None, None, :]
            # what the step would have done: admit misses into victim slots (a stand-in for the device tables)
            order = manager.next_step()[0]
            for layer in range(layers):
                missing = [e for e in routing[layer, 0, 0] if slot_of_expert[layer, e] < 0]
                free = [s for s in order[layer] if s >= 0]
                for e, s in zip(missing, free):
                    slot_of_expert[layer][slot_of_expert[layer] == s] = -1
                    slot_of_expert[layer, e] = s
            start = time.perf_counter()
            manager.record(routing.astype(np.int32), slot_of_expert.copy(), np.zeros((layers, 4), np.int32))
            manager.next_step()
            times.append(time.perf_counter() - start)
        times = np.array(times[10:]) * 1e6
        rows.append(f"| {policy} | {np.median(times):.0f} | {np.percentile(times, 90):.0f} |")
        print(rows[-1], flush=True)
    body = (f"SlotManager.record (policy update + statistics read from the step's counters) + next_step (the next step's eviction order and planned copies) for "
            f"{layers} layers x {experts} experts, top-{top_k}, batch 1, {slots} slots, {args.steps} steps of random "
            f"routing (first 10 dropped). Target: <= 200 us median.\n\n"
            "| policy | median us/step | p90 us/step |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    print(write_result("manager_cpu.md", "Cache manager time per decode step (CPU)", body))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=MODES, help="required, except with --smoke (then: all three)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench"))
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per measured run")
    parser.add_argument("--policy", default="lfru")
    parser.add_argument("--steps", type=int, default=1000, help="manager mode: steps to time")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.mode is None and not args.smoke:
        parser.error(f"name a mode ({', '.join(MODES)}), or pass --smoke to run all three at toy size")
    with smoke_run(args):
        if args.smoke:
            args.tokens, args.steps = 4, 20
        args.workdir.mkdir(parents=True, exist_ok=True)
        commands = {"compare": cmd_compare, "cache": cmd_cache, "manager": cmd_manager}
        for mode in [args.mode] if args.mode else MODES:
            commands[mode](args)


if __name__ == "__main__":
    main()
