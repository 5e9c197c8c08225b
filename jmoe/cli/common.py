"""What every command line shares: the default model, the offload flags, the kernel backend flag and the
way errors are reported (one line on stderr, exit status 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from jmoe.arguments import EXPERT_DTYPES
from jmoe.distributed import DEFAULT_TIMEOUT_S, DistributedOptions, initialize
from jmoe.errors import JmoeError
from jmoe.kernels import BACKENDS
from jmoe.offload.options import MISS_MODES, OffloadOptions
from jmoe.offload.policies import policy_names

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "default"
DIRECT_READS = {"auto": None, "on": True, "off": False}  # --direct-reads: jmoe.load's direct_reads


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help=f"model directory, Hugging Face or converted (default: the shipped model, "
                             f"{DEFAULT_MODEL_DIR})")


def resolve_model_dir(model: Path | None) -> Path:
    if model is not None:
        return model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise JmoeError(f"no --model given and the default model is not present at {DEFAULT_MODEL_DIR}; "
                        f"pass --model DIR with a Hugging Face MoE checkpoint directory")
    return DEFAULT_MODEL_DIR


def add_offload_args(parser: argparse.ArgumentParser) -> None:
    """The flags of jmoe.load's offload options and kernel backend, the same on every command line."""
    g = parser.add_argument_group("offloading")
    g.add_argument("--cache", type=cache_value, default=None, metavar="N|N1,N2,...",
                   help="experts per MoE layer kept on the device (default: all); the rest stay in pinned host "
                        "memory. One number for every MoE layer, or one per MoE layer separated by commas "
                        "('all' = that layer fully resident)")
    g.add_argument("--cpu-moe-layers", type=int, default=0, metavar="N",
                   help="keep every expert of the first N MoE layers in host memory (cache 0 there); with "
                        "--miss-mode host they are also computed there")
    g.add_argument("--policy", default="lfru", help=f"expert cache policy: {', '.join(policy_names())} (default: lfru)")
    g.add_argument("--offload-params", nargs="+", default=None, metavar="PATTERN",
                   help="more parameters to keep in host memory: dotted segments (w_down, attn) or 're:REGEX'")
    g.add_argument("--device-budget-gb", type=float, default=None,
                   help="pick the largest cache that fits in this much device memory")
    g.add_argument("--host-budget-gb", type=float, default=None,
                   help="the disk tier: keep this much of the offloaded experts in pinned host memory and read the "
                        "others from the checkpoint files when a step needs them (results unchanged)")
    g.add_argument("--read-ahead", type=int, default=0, metavar="N",
                   help="with --host-budget-gb and --prefetch-trace: as each layer routes, start reading the N "
                        "best-predicted experts of the next layer from disk (default 0: off)")
    g.add_argument("--direct-reads", choices=DIRECT_READS, default="auto",
                   help="with --host-budget-gb: read experts from disk past the page cache (O_DIRECT); 'auto' "
                        "(default) does when the page cache has room for under a quarter of them")
    g.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="copy up to N experts per layer ahead of need, guessed from the next layer's router")
    g.add_argument("--side-stream-copies", action="store_true",
                   help="on a GPU, run the copies made ahead of need (--prefetch, --prefetch-trace, the admissions "
                        "of --miss-mode host/direct) on a second stream beside the compute (results unchanged)")
    g.add_argument("--prefetch-trace", default=None, metavar="TRACE.npy",
                   help="copy experts ahead of need as predicted from routing history, by the predictor the "
                        "replay recommends fitted on this routing trace of the model ([tokens, MoE layers, k]); "
                        "with --host-budget-gb it chooses the --read-ahead reads instead")
    g.add_argument("--miss-mode", choices=MISS_MODES, default="fetch",
                   help="an expert not on the device: 'fetch' copies it in (default), 'host' computes it on the host, "
                        "'direct' has the GPU read its weights in host memory (elsewhere: as 'host')")
    g.add_argument("--offload-group-size", type=int, default=0, metavar="G",
                   help="layer-group weight prefetch: in every G layers, keep the last N layers' weights (those "
                        "matched by --offload-params, else all non-expert ones) on the host (0 = off)")
    g.add_argument("--offload-num-in-group", type=int, default=1, metavar="N", help="offloaded layers per group")
    g.add_argument("--offload-prefetch-step", type=int, default=1, metavar="K",
                   help="fetch an offloaded layer's weights when the layer K before it starts")
    g.add_argument("--scratch-rows", type=int, default=8, metavar="R",
                   help="decode rows whose missed experts all copy into the shared scratch slots (R x top-k of "
                        "them); more misses compute on the host. Fewer hold less memory (default: %(default)s)")
    g.add_argument("--devices", type=int, default=None, metavar="N",
                   help="expert parallelism: split every MoE layer's experts over this process's first N devices "
                        "(N must divide the number of experts); --cache counts per device (default: one device)")
    add_expert_dtype_args(parser)
    parser.add_argument("--backend", default="auto", help=f"expert kernel backend: {', '.join(BACKENDS)} (jmoe.kernels)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR", default=None,
                       help="JAX's persistent compilation cache directory, so a second run skips compiling "
                            "(default: $JMOE_COMPILE_CACHE, else ~/.cache/jmoe/jax)")
    cache.add_argument("--no-compile-cache", dest="compile_cache", action="store_const", const=False,
                       help="compile every program again")


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """The flags that join a jax.distributed run of several processes (jmoe.distributed)."""
    g = parser.add_argument_group("several processes (jax.distributed)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT|auto",
                   help="join a run of several processes: process 0 hosts the coordinator at HOST:PORT (give every "
                        "process the same address); 'auto' = JAX's own cluster detection (SLURM, Open MPI, ...)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's number, 0 to N-1")
    g.add_argument("--coordinator-timeout", type=int, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="seconds to wait for every process to join, and for a silent process before ending the "
                        "others (default: %(default)s)")


def distributed_options(args: argparse.Namespace) -> DistributedOptions:
    return DistributedOptions(args.coordinator, args.num_processes, args.process_id, args.coordinator_timeout)


def add_expert_dtype_args(parser: argparse.ArgumentParser) -> None:
    """--expert-dtype and --expert-group-size: how routed experts are stored and moved (jmoe.load's)."""
    g = parser.add_argument_group("expert storage")
    g.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default=None,
                   help="store the routed experts as this (default: as the checkpoint does): float32, bfloat16, "
                        "or quantized int8 / int4 / fp8 / mxfp4, moving 2-8x fewer bytes per expert")
    g.add_argument("--expert-group-size", type=int, default=None, metavar="G",
                   help="int4 only: input rows sharing one scale (default 64; must divide the hidden size and "
                        "the expert width)")


def cache_value(text: str) -> int | tuple[int | None, ...]:
    """--cache: '4' -> 4; '0,2,all' -> (0, 2, None) (checked by OffloadOptions)."""
    if "," not in text:
        return int(text)
    return tuple(None if part.strip() == "all" else int(part) for part in text.split(","))


def offload_options(args: argparse.Namespace) -> OffloadOptions:
    """The OffloadOptions of parsed `add_offload_args` flags (checked there, before any loading)."""
    return OffloadOptions(args.cache, args.policy, args.offload_params, args.device_budget_gb, args.prefetch,
                          args.miss_mode, args.offload_group_size, args.offload_num_in_group,
                          args.offload_prefetch_step, args.cpu_moe_layers, args.prefetch_trace, args.expert_dtype,
                          args.expert_group_size, args.devices, host_budget_gb=args.host_budget_gb,
                          read_ahead=args.read_ahead, scratch_rows=args.scratch_rows,
                          direct_reads=DIRECT_READS[args.direct_reads],
                          side_stream_copies=args.side_stream_copies)


def load_for_cli(model_dir: Path, options: OffloadOptions, distributed: DistributedOptions | None = None,
                 **load_kwargs):
    """jmoe.load_with_options for a command line: first, before JAX's GPU backend starts, the pinned-host pool
    limit is raised to what the placement needs (XLA reads it once, at start) and the process joins its
    distributed run, if any; then the model is loaded, and what is loaded frozen out of the garbage collector's walks
    (jmoe.collector)."""
    from jmoe.api import load_with_options
    from jmoe.collector import freeze_loaded
    from jmoe.plan.planner import raise_pinned_pool_for

    setting = raise_pinned_pool_for(model_dir, options)
    if setting and load_kwargs.get("progress", True):
        print(f"set {setting} for the pinned experts", file=sys.stderr)
    initialize(distributed or DistributedOptions())
    model = load_with_options(model_dir, options, **load_kwargs)
    freeze_loaded()  # the command compiles and runs next: jmoe.collector says why
    return model


def run_cli(main: Callable[[], int]) -> int:
    """Run a command's body; a JmoeError becomes one line on stderr and exit status 2."""
    try:
        return main()
    except JmoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
