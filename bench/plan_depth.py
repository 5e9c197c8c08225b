"""jmoe.plan of a deep model from two shallow compiles (jmoe.plan.depth) against compiling every layer: the numbers
the plan reads from the programs, and what each way costs.

  python -m bench.plan_depth [--models default-18,default-48,qwen3-30b-a3b] [--reduced-only qwen3-235b-a22b]
  python -m bench.plan_depth --smoke   # default-16 at smoke size, extrapolated only, context 64, no result file

Each model is a header-only checkpoint (bench.plan's shapes; `default-N` is the shipped default model's shape at N
layers), planned for an H100 at cache 4 (16 for the Qwen3 models), context 1024, in this process. Writes
bench/results/plan_depth.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.helpers.common import add_smoke_argument, smoke_run, smoke_spec, write_result
from bench.plan import MODELS, write_header_only_checkpoint

DEFAULT = Path(__file__).resolve().parents[1] / "checkpoints/default/config.json"
CONTEXT = 1024


def model_config(name: str, smoke: bool = False) -> tuple[dict, int]:
    """(config.json, cache) of a model name: one of bench.plan's, or default-N (at smoke size: N layers kept)."""
    if name.startswith("default-"):
        layers = int(name.split("-")[1])
        config = {**json.loads(DEFAULT.read_text()), "dtype": "bfloat16", "torch_dtype": "bfloat16"}
        return {**(smoke_spec(config) if smoke else config), "num_hidden_layers": layers}, 4
    return MODELS[name], 16


def planned(directory: Path, cache: int, extrapolate: bool, context: int):
    import jmoe

    start = time.perf_counter()
    plan = jmoe.plan(directory, cache, target="h100", context=context, host_gb=256, extrapolate_layers=extrapolate)
    return plan, time.perf_counter() - start


def rows_for(name: str, workdir: Path, reduced_only: bool, smoke: bool = False) -> list[str]:
    config, cache = model_config(name, smoke)
    context = 64 if smoke else CONTEXT
    directory = write_header_only_checkpoint(workdir / name, config)
    reduced, reduced_s = planned(directory, cache, True, context)
    if reduced.programs["decode"].compiled_layers is None:
        raise RuntimeError(f"{name}: the plan compiled every layer; expected two shallow depths")
    whole, whole_s = (None, None) if reduced_only else planned(directory, cache, False, context)
    rows = []
    for program in ("decode", "prefill"):
        approx = reduced.programs[program]
        exact = None if whole is None else whole.programs[program]
        sizes = approx.device_bytes  # arguments + outputs - aliases: an extrapolated program has no temporaries
        exact_sizes = None if exact is None else exact.device_bytes - exact.memory_analysis["temp_size_in_bytes"]

        def compare(value, truth):
            return "-" if truth is None else f"{value / truth - 1:+.2%}"

        layers = ("whole" if approx.compiled_layers is None
                  else f"{approx.compiled_layers[0]} and {approx.compiled_layers[1]}")
        temporaries = "-" if exact is None else f"{exact.memory_analysis['temp_size_in_bytes'] / 2**30:.3f}"
        rows.append(
            f"| {name} | {config['num_hidden_layers']} | {program} | {layers} | {sizes / 2**30:.3f} | "
            f"{compare(sizes, exact_sizes)} | {temporaries} | "
            f"{compare(approx.cost_analysis['flops'], exact and exact.cost_analysis['flops'])} | "
            f"{compare(approx.cost_analysis['bytes accessed'], exact and exact.cost_analysis['bytes accessed'])} | "
            f"{'same' if exact is None or approx.control_flow == exact.control_flow else 'DIFFERENT'} | "
            f"{reduced_s:.0f} | {'-' if whole_s is None else f'{whole_s:.0f}'} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.plan_depth", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default-18,default-48,qwen3-30b-a3b")
    p.add_argument("--reduced-only", default="qwen3-235b-a22b", help="models planned only the fast way")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_plan_depth"))
    add_smoke_argument(p)
    args = p.parse_args(argv)
    with smoke_run(args):
        if args.smoke:
            args.models, args.reduced_only = "", "default-16"
        report(args)


def report(args) -> None:
    load = open("/proc/loadavg").read().split()[:3]
    rows = []
    for names, reduced_only in ((args.models, False), (args.reduced_only, True)):
        for name in filter(None, names.split(",")):
            rows += rows_for(name, args.workdir, reduced_only, args.smoke)
    text = "\n".join([
        f"H100 target, context {CONTEXT}, batch 1, bf16; load average {' '.join(load)} at the start. Sizes: "
        f"arguments + outputs - aliases (an extrapolated program counts no temporaries); errors are the "
        f"extrapolated value against compiling every layer; plan seconds are whole jmoe.plan calls (the "
        f"programs compile side by side).", "",
        "| model | layers | program | compiled layers | sizes GiB (extrapolated) | sizes error | temporaries GiB "
        "(every layer) | flops error | bytes accessed error | loops and kernels | plan s | plan s, every layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]) + "\n"
    print(text)
    print(write_result("plan_depth.md", "Deep models planned from two shallow compiles", text))


if __name__ == "__main__":
    main()
