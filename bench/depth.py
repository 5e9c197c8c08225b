"""What a model's depth costs at start-up, and what running its layers under `lax.scan` would change (issue #55).

  python -m bench.depth [--rounds 2] [--parts generate,chain,h100,h100_chain,scan]
  python -m bench.depth --smoke   # every part at toy sizes and depths, no result file

1. generate (CPU): `python -m jmoe.generate --max-new-tokens 1` from an empty compilation cache, wall seconds to its
   first token and the compile seconds it reports; random checkpoints written by transformers: the shipped model's width
   at 4 and 32 layers, and a DeepSeek-V3-shaped model of small width (MLA, grouped router, three dense layers first) at
   8 and 61 layers, every expert resident and with `--cache 4` (4 of 16 in device slots). Each start is its own process,
   the depths alternate, medians of --rounds. Both deep models' steps run as chains of layer-block programs
   (jmoe.decode.chain), the shallow ones' as one program.
2. chain (CPU): the deep models of part 1, every expert resident and then 4 of each MoE layer's 16 in device slots
   (router prefetch 1), with their steps chained and as one program over every layer, both loaded
   in one process without a compilation cache: the compile seconds of their prompt programs (16- and 256-token
   buckets) and decode program, then medians over 3 x --rounds alternated generations of 64 tokens: prefill ms at
   both lengths and decode ms a token, and the chain's against the one program's; the decode bound is the weights
   a decoded token reads at the machine's measured streaming read bandwidth.
3. h100: jmoe.plan for an H100 with every layer compiled (no extrapolation) of header-only DeepSeek-V3 checkpoints
   at 8 / 32 / 61 layers (cache 16, context 1024): each program's compile seconds, as the plan measures them (decode
   and prefill compile side by side on their own threads).
4. h100_chain: DeepSeek-V3 with every expert resident (8 / 32 / 61 layers) and with 16 cache slots a layer and
   router prefetch 2 (8 / 61 layers), its greedy decode step compiled for an H100 (compile-only, nothing allocated)
   as one program over every layer and chained in layer blocks (bench/helpers/chain_h100.py): compile seconds,
   programs compiled, loops and conditionals.
5. scan: a stand-in layer (a dense product, a router, jmoe.kernels.moe_ffn on its experts) repeated L times, the
   loop unrolled over per-layer arrays against `lax.scan` over stacked ones: the CPU step time (a dense-only
   layer, the product XLA:CPU runs from a slice of a stacked weight; also a loop that picks each layer's own weight
   arrays with lax.switch), and for an H100 (compile-only) the compile
   seconds and temporaries of three forms: unrolled, scanned over slices of the stacked experts, and scanned with
   the expert ids offset into every layer's stack (`ids + l * E` over [L * E, ...]), which slices nothing; and the
   dense layers compiled for an H100 too, with what the scanned program copies out of the stack every layer.

Writes bench/results/depth.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.compare_cpu import load_average, load_warning, quiet_start_load
from bench.helpers.common import (DEFAULT_MODEL, add_smoke_argument, read_bandwidth_gbs, smoke_run, smoke_spec,
                                  write_first_layers, write_random_checkpoint, write_result)

PARTS = ("generate", "chain", "h100", "h100_chain", "scan")
SMOKE_DEPTH = 2  # a smoke run's generate part: one cold start, the code of every depth (a second was ~2 s of CPU)
# A DeepSeek-V3-shaped model at the shipped model's width, with its vocabulary so that its tokenizer applies.
DEEPSEEK_SMALL = dict(
    model_type="deepseek_v3", vocab_size=4096, hidden_size=192, intermediate_size=384, moe_intermediate_size=192,
    first_k_dense_replace=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=96,
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=1024,
    rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def default_width() -> dict:
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    return {key: value for key, value in config.items() if key not in ("architectures", "dtype")}


def tokenized_checkpoint(directory: Path, spec: dict, layers: int) -> Path:
    """A random checkpoint of `spec` at `layers` decoder layers, written by transformers, with the shipped model's
    tokenizer."""
    spec = {**spec, "num_hidden_layers": layers}
    directory = write_random_checkpoint(directory, spec.pop("model_type"), **spec)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (DEFAULT_MODEL / name).is_file():
            shutil.copy(DEFAULT_MODEL / name, directory / name)
    return directory


def first_layers(directory: Path, layers: int) -> Path:
    """The shipped model's first `layers` layers (written once into `directory`)."""
    if not (directory / "config.json").is_file():
        write_first_layers(DEFAULT_MODEL, directory, layers)
    return directory


def first_token(model: Path, workdir: Path, flags: tuple[str, ...] = ()) -> dict:
    """One cold `python -m jmoe.generate` for one token (with `flags`): wall seconds and generate's own timing."""
    cache = Path(tempfile.mkdtemp(prefix="cache_", dir=workdir))
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "jmoe.generate", "--model", str(model), "--max-new-tokens", "1",
                           "--json", "--compile-cache", str(cache), *flags], check=True, capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    wall = time.monotonic() - began
    shutil.rmtree(cache)
    return {"wall": wall, "compile": json.loads(done.stdout)["timing"]["compile_seconds"]}


def generate_part(args) -> list[str]:
    offloaded = ("--cache", "4")  # 4 of the 16 experts of every MoE layer in device slots
    if args.smoke:  # the shipped model's first layers, one depth (each is a cold process): no transformers to import
        models = [(name, (SMOKE_DEPTH,), lambda n: first_layers(args.workdir / f"default_{n}", n), flags)
                  for name, flags in (("default model's first layers", ()), ("the same, --cache 4", offloaded))]
    else:
        models = [(name + label, depths, lambda n, spec=spec: tokenized_checkpoint(
                   args.workdir / f"{spec['model_type']}_{n}", spec, n), flags)
                  for label, flags in (("", ()), (", --cache 4", offloaded))
                  for name, spec, depths in (("default width", default_width(), (4, 32)),
                                             ("DeepSeek-V3 shape, small width", DEEPSEEK_SMALL, (8, 61)))]
    rows = ["| model | layers | first token, cold (s) | of which generate's compile (s) | against the shallowest |",
            "|---|---|---|---|---|"]
    for name, depths, write, flags in models:
        paths = {n: write(n) for n in depths}
        runs = {n: [] for n in depths}
        for round_index in range(args.rounds):
            for n in (depths if round_index % 2 == 0 else depths[::-1]):
                print(f"generate: {name}, {n} layers, round {round_index + 1}", file=sys.stderr, flush=True)
                runs[n].append(first_token(paths[n], args.workdir, flags))
        wall = {n: statistics.median(r["wall"] for r in runs[n]) for n in depths}
        for n in depths:
            compile_s = statistics.median(r["compile"] for r in runs[n])
            rows.append(f"| {name} | {n} | {wall[n]:.1f} | {compile_s:.1f} | {wall[n] / wall[depths[0]]:.2f}x |")
    return rows


def chain_part(args) -> list[str]:
    """The deep models' generation steps as a chain of layer-block programs (jmoe.decode.chain, what jmoe.load gives
    them) against one program over every layer (the step before the chain), both loaded in this process with no
    compilation cache: compile seconds of the prompt and decode programs, then medians of alternated generations."""
    from unittest import mock

    import jmoe
    import jmoe.api
    from jmoe.decode import chain
    from bench.decode import weight_reads
    from jmoe.decode.sampling import SamplingParams

    offloaded = dict(cache=4, prefetch=1)  # 4 of the 16 experts of every MoE layer in device slots
    if args.smoke:  # the shipped model's first two layers chained one a block, whatever chains() would decide
        path = first_layers(args.workdir / "chain", SMOKE_DEPTH)
        models = [("default model's first layers", SMOKE_DEPTH, path, {}),
                  ("the same, cache 4, prefetch 1", SMOKE_DEPTH, path, offloaded)]
        layers_per_program = 1
    else:
        paths = {name: (n, tokenized_checkpoint(args.workdir / f"{spec['model_type']}_{n}", spec, n))
                 for name, spec, n in (("default width", default_width(), 32),
                                       ("DeepSeek-V3 shape, small width", DEEPSEEK_SMALL, 61))}
        models = [(name + label, *paths[name], options) for label, options in (("", {}), (", cache 4, prefetch 1",
                                                                                          offloaded))
                  for name in paths]
        layers_per_program = chain.LAYERS_PER_PROGRAM
    greedy, new_tokens = SamplingParams(0.0, 0, 1.0), 4 if args.smoke else 64
    bandwidth = read_bandwidth_gbs(args.smoke)
    prompts = {"16": [[(7 * i) % 4000 + 1 for i in range(10)]], "256": [[(7 * i) % 4000 + 1 for i in range(200)]]}
    rows = ["| model | layers | step | compile (s) | prefill 16 (ms) | prefill 256 (ms) | decode (ms/token) | "
            "share of decode bound |", "|---|---|---|---|---|---|---|---|"]
    bounds, notes = [], []
    for name, n, path, options in models:
        loaded = {}
        with mock.patch.object(chain, "LAYERS_PER_PROGRAM", layers_per_program):
            for form, decides in (("one program", lambda config, engine: False), ("chained", None)):
                with mock.patch.object(jmoe.api, "chains", decides or (
                        lambda config, engine: args.smoke or chain.chains(config, engine))):
                    model = jmoe.load(path, progress=False, compile_cache=False, **options)
                compiled = sum(model.generate_detailed(p, new_tokens, greedy).compile_seconds for p in prompts.values())
                loaded[form] = (model, compiled, {"16": [], "256": [], "decode": []})
        for round_index in range(max(3, 3 * args.rounds)):
            print(f"chain: {name}, round {round_index + 1}", file=sys.stderr, flush=True)
            for form in (loaded if round_index % 2 == 0 else list(loaded)[::-1]):
                model, _, runs = loaded[form]
                for length, prompt in prompts.items():
                    result = model.generate_detailed(prompt, new_tokens, greedy)
                    runs[length].append(result.prefill_seconds * 1e3)
                    runs["decode"].append(result.decode_seconds * 1e3 / result.decode_steps)
        if options:  # the same generations in the same order: each form's slots saw the same steps
            same = loaded["chained"][0].stats() == loaded["one program"][0].stats()
            notes.append(f"{name}: cache statistics (hits, misses, copies, evictions per layer) "
                         f"{'equal' if same else 'DIFFERENT'} between the two forms.")
        medians = {form: {k: statistics.median(v) for k, v in runs.items()} for form, (_, _, runs) in loaded.items()}
        bound_ms = weight_reads(loaded["chained"][0]).step() / bandwidth / 1e6
        bounds.append(f"{name}: {weight_reads(loaded['chained'][0]).step() / 1e6:.1f} MB, {bound_ms:.2f} ms")
        for form, (_, compiled, _) in loaded.items():
            m, one = medians[form], medians["one program"]
            ratio = "" if form == "one program" else " ({:.2f}x)"
            rows.append(f"| {name} | {n} | {form} | {compiled:.1f} | " + " | ".join(
                f"{m[k]:.2f}{ratio.format(m[k] / one[k])}" for k in ("16", "256", "decode"))
                + f" | {bound_ms / m['decode']:.0%} |")
    return rows + ["", "Decode bound: the weights a decoded token reads (dense matrices, top-k experts per MoE layer, "
                   f"one embedding row; bench.decode.weight_reads) at the measured {bandwidth:.1f} GB/s streaming read "
                   "bandwidth (a jitted sum over 1 GiB): " + "; ".join(bounds) + " a token.", "", *notes]


def h100_part(args) -> list[str]:
    import jmoe
    from bench.plan import MODELS, write_header_only_checkpoint

    # A smoke run plans the smallest model there is (the shipped model's layer at smoke width): the plan's code path.
    name, spec = (("default width", smoke_spec(default_width())) if args.smoke
                  else ("DeepSeek-V3", MODELS["deepseek-v3"]))
    rows = ["| model | layers | decode compile (s) | prefill compile (s) | plan (s) |", "|---|---|---|---|---|"]
    for n in (1,) if args.smoke else (8, 32, 61):
        directory = write_header_only_checkpoint(args.workdir / f"header_only_{n}", {**spec, "num_hidden_layers": n})
        began = time.monotonic()
        plan = jmoe.plan(directory, 16, target="h100", context=64 if args.smoke else 1024, host_gb=1024,
                         extrapolate_layers=False)
        seconds = {program: plan.programs[program].compile_seconds for program in ("decode", "prefill")}
        rows.append(f"| {name} | {n} | {seconds['decode']:.1f} | {seconds['prefill']:.1f} | "
                    f"{time.monotonic() - began:.0f} |")
    return rows


def child_rows(module: str, args) -> list[str]:
    """The table rows `module`'s main prints, in a child process: it must choose JAX's platform before any backend
    starts (bench/helpers/layer_scan.py, chain_h100.py)."""
    command = [sys.executable, "-c", f"import sys; from bench.helpers.{module} import main; main(sys.argv[1:])",
               *(["--smoke"] if args.smoke else [])]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.depth", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS), help=", ".join(PARTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench_depth"))
    parser.add_argument("--allow-load", action="store_true", help="write the report even if the machine is busy")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(args.parts) - set(PARTS))}; choose from {', '.join(PARTS)}")
    with smoke_run(args):
        if args.smoke:
            args.rounds = 1
        start_load = quiet_start_load("bench.depth", args.allow_load or args.smoke)
        args.workdir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        titles = {"generate": "First token against depth (CPU)",
                  "chain": "A deep model's step chained in layer blocks, against one program (CPU)",
                  "h100": "Compile seconds against depth, H100 compile-only, every layer compiled",
                  "h100_chain": "A deep model's decode step chained, H100 compile-only",
                  "scan": "The layer loop unrolled or under lax.scan (stand-in layer)"}
        sections = []
        for part in args.parts:
            rows = {"generate": generate_part, "chain": chain_part, "h100": h100_part,
                    "h100_chain": lambda args: child_rows("chain_h100", args),
                    "scan": lambda args: child_rows("layer_scan", args)}[part](args)
            sections += [f"## {titles[part]}", "", *rows, ""]
        text = "\n".join([load_warning(start_load) + f"Load average {start_load:.2f} at the start, "
                          f"{load_average():.2f} at the end; whole run {time.monotonic() - began:.0f} s.", "",
                          *sections])
        path = write_result("depth.md", "What depth costs at start-up, and layers under scan", text)
        print(path.read_text())


if __name__ == "__main__":
    main()
