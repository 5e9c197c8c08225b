"""The default model's decode and prefill steps compiled for an H100 on this CPU machine (jmoe.plan with the
CUDA PJRT plugin, nothing runs): per configuration, the control flow a GPU would run (conditionals and loops
whose trip count is data both make it wait for the host), the Triton kernels, and the device memory.

    python -m bench.h100_programs [--model checkpoints/default] [--context 256]
    python -m bench.h100_programs --smoke   # one configuration (cache 4, fetch, batch 1), context 16, no result,
                                            # the model's first layer (a header-only copy)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jmoe
from bench.helpers.common import add_smoke_argument, smoke_run, write_result
from bench.plan import write_header_only_checkpoint
from jmoe.plan.hlo import side_stream_overlaps

# (label, jmoe.plan options, batch)
CONFIGURATIONS = [
    ("resident, auto", dict(), 1),
    ("resident, auto", dict(), 8),
    ("resident, pallas", dict(backend="pallas"), 8),
    ("cache 4, fetch", dict(cache=4), 1),
    ("cache 4, fetch", dict(cache=4), 8),
    ("cache 4, fetch, prefetch 2", dict(cache=4, prefetch=2), 1),
    ("cache 4, fetch, prefetch 2", dict(cache=4, prefetch=2), 8),
    ("cache 4, host", dict(cache=4, miss_mode="host"), 1),
    ("cache 4, host", dict(cache=4, miss_mode="host"), 8),
    ("cache 4, direct", dict(cache=4, miss_mode="direct"), 1),
    ("cache 4, direct", dict(cache=4, miss_mode="direct"), 8),
    ("cache 4, fetch, prefetch 2, side stream", dict(cache=4, prefetch=2, side_stream_copies=True), 1),
    ("cache 4, direct, side stream", dict(cache=4, miss_mode="direct", side_stream_copies=True), 1),
    ("cache 4, direct, prefetch 2, side stream", dict(cache=4, miss_mode="direct", prefetch=2,
                                                      side_stream_copies=True), 1),
]
SMOKE_CONFIGURATIONS = [("cache 4, fetch", dict(cache=4), 1)]  # the offload engine's decode and prefill
SMOKE_LAYERS = 1  # XLA:GPU's compile grows by seconds a layer; one layer has every kernel of the offloaded step


def row(label: str, batch: int, name: str, program) -> str:
    if program.error is not None:
        reason = program.error.strip().splitlines()[-1][:90]
        return f"| {label} | {batch} | {name} | not compiled: {reason} | | | | | | | |"
    flow = program.control_flow
    beside = ", ".join(map(str, side_stream_overlaps(program.hlo_text))) or "-"
    return (f"| {label} | {batch} | {name} | {flow.conditionals} | {flow.loops_with_known_trip_count} | "
            f"{flow.data_dependent_loops} | {program.kernels} | {flow.triton_kernels} | "
            f"{flow.triton_kernels_reading_host} | {beside} | {program.device_bytes / 2**20:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/default")
    parser.add_argument("--context", type=int, default=256)
    add_smoke_argument(parser)
    args = parser.parse_args()
    with smoke_run(args):
        if args.smoke:
            config = {**json.loads((Path(args.model) / "config.json").read_text()), "num_hidden_layers": SMOKE_LAYERS}
            args.model = write_header_only_checkpoint(args.workdir / "model", config)
            args.context = 16
        report(args, SMOKE_CONFIGURATIONS if args.smoke else CONFIGURATIONS)
    return 0


def report(args, configurations: list) -> None:
    lines = ["| configuration | batch | program | conditionals | loops, known trip count | loops, data-dependent "
             "| kernel launches a run | Triton kernels | of them reading host memory | kernels beside each side-stream "
             "call | device MiB |", "|---" * 11 + "|"]
    for label, options, batch in configurations:
        plan = jmoe.plan(args.model, target="h100", batch=batch, context=args.context, **options)
        for name in ("decode", "prefill"):
            program = plan.programs[name]
            if args.smoke and program.error is not None:  # a real run reports it in the table
                raise SystemExit(f"h100_programs --smoke: {label}, batch {batch}: {name} not compiled:\n"
                                 f"{program.error}")
            lines.append(row(label, batch, name, program))
            print(lines[-1], flush=True)
    body = (f"Model: `{args.model}` (qwen3_moe, 16 experts, top-2, 4 MoE layers), float32, KV cache of "
            f"{args.context} tokens; each program compiled by `jmoe.plan(..., target=\"h100\")` in a child "
            "process. Compile-only: these are the programs XLA:GPU would run, not measurements of a GPU.\n\n"
            + "\n".join(lines) + "\n\n"
            "Before this change (the issue's audit of the same model): the resident decode had one conditional "
            "per MoE layer, and batch 8 with `--cache 4` had 20 conditionals and 8 loops of unknown trip count; "
            "`backend=\"pallas\"` compiled to no Triton kernel.\n\n"
            "Every copy of experts into slots (decode's demand copies and planned admissions, prefill's chunks) "
            "is one Triton kernel reading the pinned-host experts as they are (jmoe.kernels.expert_copy; counted "
            "in the column 'reading host memory'), whose programs for entries past the last miss move nothing: "
            "no loop of unknown trip count is left (each such loop read its condition back to the host every "
            "iteration).\n\n"
            "Miss mode \"direct\": the decode's expert kernels of each offloaded layer (gate-up and down) are "
            "handed the layer's pinned-host experts as they are too, so the misses are computed without demand "
            "copies; its copy kernels are the manager's planned admissions (at most one expert a layer and "
            "step).\n\n"
            "Side stream (`side_stream_copies=True`): the decode's copies made ahead of need (router prefetch into "
            "the next layer, direct's planned admissions at the step's start) are asynchronous calls on a second "
            "stream; the column lists, for each, the compute stream's kernels XLA scheduled between its start and "
            "its done (`jmoe.plan.hlo.side_stream_overlaps`), which it can run beside. The demand copies and "
            "prefill's chunks stay on the compute stream (on a second one XLA's scheduler still ran each chunk's "
            "copy alone). Router prefetch's copies had nothing beside them from e0cca3c (5, 5 and 6 kernels "
            "before: the scratch path's, which a step whose cache admits every miss no longer has) to 14b4c48 (24, 2 "
            "and 3 since); direct's with router prefetch none from e502245 (80, 19, 19, 19, 2, 4, 0 before) to "
            "2ee4955 (40, 18, 18, 18, 0, 5, 5 since): XLA 0.10.2's default scheduler puts each done right after its "
            "start unless the order it happens to pick says otherwise. Whether an "
            "overlap shortens a step is for a GPU to measure (`python -m bench.gpu_decode_bound`).\n\n"
            "Kernel launches a run: `jmoe.plan.hlo.kernel_count` (the entry computation's kernels, its asynchronous "
            "calls' and each loop's body and condition times its trip count), what the plan's estimate charges a "
            "launch cost for. The default model's resident decode at batch 1 launched 248 before 7c13241 and "
            "49e8591 (its tile layouts' loops and sorts), 118 before 5cbdb43 and 6cfc997 (its projections' products "
            "written out whole, its one token's pairs laid out by comparison: bench/results/dense_layout_h100.md), "
            "99 before 7e41ea4 (a row laid into tiles for the expert kernels, now matrix-vector programs); the fetch "
            "decode 406, 192, 200 from 20bac92 (each layer's tables bound apart: among others a copy a layer of the "
            "zeros jnp.nonzero scatters into, which XLA shares between the layers), 160 from 6cfc997, 137 from "
            "e0cca3c (no scratch copy and expert kernel where the cache slots outnumber the experts a step routes "
            "to; with router prefetch 173 -> 148), 133-134 from 7e41ea4 (the one-row expert kernels). Counted since "
            "510c946 with the kernels whose result is a tuple of six or more arrays, which the count had missed (at "
            "c4e4396 so counted: resident 95, fetch 138, direct 128, batch-8 fetch 227): resident 88 from 85c3fdc (a "
            "layer's choice of experts one kernel), fetch 107 from 510c946 and 1079a23 (its bookkeeping one kernel a "
            "layer), direct 105 from bc47d21 and 51df930 (cached and missed experts in the same two kernels; each "
            "table written once a step); resident 68, fetch 87, direct 89 (batch 8: 90, 149, 143) from 5da6d71 and "
            "dd5af81 (a layer's attention one kernel, where XLA made the two cache writes, the scores, the softmax and "
            "the products five; the queries and keys roped as one array), 64, 83, 81 (batch 8: 80, 139, 133) from "
            "e502245 (the router's softmax in the choice's kernel), 60, 79, 81 (batch 8: 80, 138, 133) from 14b4c48 "
            "and 885a6f8 (a one-token step's norms one kernel each, with the residual add before them; direct's "
            "planned admissions' tables, whose updates XLA now fuses across layers, copied first, a kernel a layer), "
            "direct 78 (batch 8: 126) from 2ee4955 (those tables made once, no copy).\n\n"
            "No program has a loop left: the grouped GEMM's tile layout searched its groups' ends with a loop of "
            "log2(groups) iterations (one per expert kernel call and layer: the 4 and 8 loops of known trip count "
            "the resident and offloaded programs had until 7c13241), each iteration launching its kernels again.\n\n"
            "Host miss mode's decode cannot be compiled for a GPU target with jax 0.10 (XLA:CPU's thunk emitter "
            "rejects the host computation's `async-start` in compile-only mode); its CPU-compiled program has no "
            "conditional and every data-dependent loop inside the host computation "
            "(tests/test_gpu_step.py).\n")
    print(write_result("h100_programs.md", "Decode and prefill programs compiled for an H100", body))


if __name__ == "__main__":
    raise SystemExit(main())
