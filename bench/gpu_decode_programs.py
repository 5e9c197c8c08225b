"""The decode programs bench.gpu_decode_bound runs on a lent GPU, compiled for an H100 on this CPU first (nothing
runs, nothing is allocated): a GPU's minutes are too few to find out there that a program does not compile.

  python -m bench.gpu_decode_programs            # -> bench/results/gpu_decode_programs_h100.md
  python -m bench.gpu_decode_programs --smoke    # two small settings (one program, one chain), no result file

Per setting of gpu_decode_bound's default variant and of its GPT-OSS-120B shape (its settings, its models' configs,
batch 1, 1,024 cache columns), the step built as a Model builds it: chained in layer blocks where
jmoe.decode.chain.chains says (the 120B shape's 36 layers are), one program otherwise. For each: the compile seconds,
the programs compiled and those a step dispatches, and what a GPU would run (jmoe.plan.hlo.control_flow): loops with
a known trip count, data-dependent ones on the device (a host round trip an iteration) and on the host, conditionals,
Triton kernels and those that read host memory; the kernels a step launches (jmoe.plan.hlo.kernel_count), the
kernels XLA schedules beside each call on a second stream (jmoe.plan.hlo.side_stream_overlaps: what a copy made ahead
could overlap), its scatters (jmoe.plan.hlo.scatters: the largest array one writes into) and the bytes its programs
read and write by XLA's cost analysis, which does not see the Pallas kernels' (the experts'). Each
setting compiles in a process of its own, so that an XLA check failure (under jax 0.10, the host computations of miss
mode "host" with more than one caller) loses only that setting, recorded with the last lines it printed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time

from bench.gpu_decode_bound import BIG, big_config, label_of, placing_of, settings_of
from bench.helpers.common import add_smoke_argument, smoke_run, write_result

CONTEXT = 1024
FLOW_COLUMNS = ("loops_with_known_trip_count", "data_dependent_loops", "host_loops", "conditionals", "triton_kernels",
                "triton_kernels_reading_host")


def settings(small: bool, smoke: bool) -> list[dict]:
    """gpu_decode_bound's settings whose programs differ: its default variant's and the big shape's (the flag
    variants run the default's programs under other XLA flags). A smoke run: the first offloaded one of each, one
    program and one chain."""
    default, big = settings_of("default", small, smoke), settings_of(BIG, small, smoke)
    if smoke:
        return [next(s for s in group if s["miss_mode"] == "fetch") for group in (default, big)]
    return default + big


def model_config(setting: dict, small: bool):
    """The ModelConfig gpu_decode_bound's model of `setting` has: a gpu_check checkpoint's (bfloat16), or the big
    shape's with MXFP4 experts."""
    from bench.gpu.models import SPEED_DTYPE, speed_config, with_dtype
    from jmoe.config import parse_config, with_expert_dtype

    if setting["model"] == BIG:
        return with_expert_dtype(parse_config(big_config(small)), "mxfp4")
    return parse_config(with_dtype(speed_config(setting["model"], small), SPEED_DTYPE))


def compile_setting(setting: dict, small: bool) -> dict:
    """One setting's decode step compiled for an H100 (in this process: bench.helpers.chain_h100 puts JAX on its CPU
    platform as it is imported)."""
    from bench.helpers.chain_h100 import compile_step
    from jmoe.offload.options import OffloadOptions

    options = (OffloadOptions() if setting["miss_mode"] == "resident"
               else OffloadOptions(miss_mode=setting["miss_mode"], **placing_of(setting)))
    step = compile_step(model_config(setting, small), options, context=CONTEXT)
    return {"seconds": step.seconds, "chained": step.chained, "programs_compiled": step.programs_compiled,
            "programs_a_step": step.programs_a_step, **step.flow.as_dict(), "kernels": step.kernels,
            "beside_side_stream": step.beside_side_stream, "scatters": step.scatters, "mb_accessed": step.mb_accessed}


def run_child(setting: dict, small: bool) -> dict:
    """compile_setting in a process of its own: its result, or why it has none."""
    command = [sys.executable, "-m", "bench.gpu_decode_programs", "--child", json.dumps(setting)]
    done = subprocess.run(command + ["--small"] * small, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    # an XLA check failure's own line, or a Python error's, before the stack trace that follows it
    said = [line for line in lines if "Check failed" in line or re.match(r"\w*(Error|Exception)\b", line)]
    return {"error": f"exit {done.returncode}: {(said or lines or ['nothing printed'])[-1][:300]}"}


def report(rows: list[tuple[dict, dict]], small: bool) -> str:
    from importlib.metadata import version

    lines = [f"Batch 1, {CONTEXT} cache columns, greedy decode, compiled for an H100 (jmoe's shipped target) by "
             f"jax {version('jax')}'s CUDA plugin on this CPU{' (small shapes)' if small else ''}.", "",
             "A setting that did not compile says why: under jax 0.10, miss mode \"host\" of more than one offloaded "
             "layer (its host computation with several callers: XLA:CPU's thunk emitter has no async-start), which "
             "jax 0.11's jmoe.memory.transformed_at_each_call is meant to avoid on the GPU.", "",
             "| setting | chained | compile s | programs compiled | a step | loops, known trip count | loops, "
             "data-dependent (device) | loops on the host | conditionals | Triton kernels | of them reading host | "
             "kernels a step | kernels beside each second-stream copy | scatters (largest operand, elements) "
             "| MB accessed a step |",
             "|---" * 15 + "|"]
    for setting, result in rows:
        if "error" in result:
            lines.append(f"| {label_of(setting)} | did not compile: {result['error'].replace('|', '/')} |" + " |" * 13)
            continue
        accessed = result["mb_accessed"]
        lines.append(f"| {label_of(setting)} | {'yes' if result['chained'] else 'no'} | {result['seconds']:.1f} | "
                     f"{result['programs_compiled']} | {result['programs_a_step']} | "
                     + " | ".join(str(result[key]) for key in FLOW_COLUMNS) + f" | {result['kernels']} | "
                     f"{', '.join(map(str, result['beside_side_stream'])) or '-'} | {scattered(result['scatters'])} | "
                     f"{'unknown' if accessed is None else f'{accessed:.0f}'} |")
    return "\n".join(lines) + "\n"


def scattered(found: list) -> str:
    """How many scatters, and the elements of the largest array one writes into: a buffer of experts scattered into
    would show as millions (#54 item 2: an admission writes its expert in place, no scatter)."""
    return f"{len(found)} ({max(math.prod(operand) for operand, _ in found)})" if found else "0"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_decode_programs", description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="gpu_decode_bound's small shapes")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one setting, as JSON
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    args.small = args.small or args.smoke
    if args.child is not None:
        print(json.dumps(compile_setting(json.loads(args.child), args.small)))
        return
    with smoke_run(args):
        began = time.monotonic()
        rows = []
        for setting in settings(args.small, args.smoke):
            rows.append((setting, run_child(setting, args.small)))
            print(f"{label_of(setting)}: {rows[-1][1]}", file=sys.stderr, flush=True)
        text = report(rows, args.small) + f"\nWhole run {time.monotonic() - began:.0f} s.\n"
        print(write_result("gpu_decode_programs_h100.md", "gpu_decode_bound's decode programs, compiled for an H100",
                           text))
    if any("error" in result for _, result in rows) and args.smoke:
        raise SystemExit("error: a setting did not compile")


if __name__ == "__main__":
    main()
