"""Command line: `python -m jmoe.plan MODEL [--target h100] [--cache N | --device-budget-gb X] [--json]`.

Prints where every byte would live and whether it fits (exit status 0 when it fits, 1 when it does not),
from config.json and the checkpoint headers alone; with --target, for that GPU, compiling the decode and
prefill programs for it and estimating tokens/s there (--hit-rate / --trace, --host-link-gbs). With
--host-budget-gb (the disk tier), also what a decoded token reads from disk (--host-hit-rate, --disk-gbs). Takes
the same offload flags as jmoe.generate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jmoe.cli.common import add_offload_args, offload_options, run_cli
from jmoe.errors import JmoeError


def build_parser() -> argparse.ArgumentParser:
    from jmoe.plan.targets import target_names

    p = argparse.ArgumentParser(prog="python -m jmoe.plan", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="model directory, Hugging Face or converted (only headers are read)")
    p.add_argument("--target", default=None,
                   help=f"GPU to plan for: {', '.join(target_names())}, or a target-config file (default: this "
                        f"machine)")
    p.add_argument("--no-compile", action="store_true",
                   help="with --target, skip compiling the programs (faster; their temporaries are not counted)")
    p.add_argument("--extrapolate-layers", action="store_true",
                   help="compile a deep model (16+ repeating layers) at two shallow depths and extrapolate the "
                        "programs' sizes and cost (several times faster; temporaries not counted)")
    p.add_argument("--batch", type=int, default=1, help="rows planned for (default 1)")
    p.add_argument("--context", type=int, default=None,
                   help="KV-cache tokens planned for (default: 4096, capped by the model)")
    p.add_argument("--host-gb", type=float, default=None, help="host memory available, GiB (default: the OS's)")
    p.add_argument("--device-gb", type=float, default=None,
                   help="device memory available, GiB (default: the target's, or this machine's)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    p.add_argument("--hit-rate", type=float, default=None,
                   help="speed estimate: the offloaded layers' expert-cache hit rate (default: uniform routing, "
                        "cache / experts)")
    p.add_argument("--trace", type=Path, default=None,
                   help="speed estimate: a .npy routing trace of the model [tokens, MoE layers, k], replayed with "
                        "--policy and the plan's caches for the hit rate")
    p.add_argument("--host-link-gbs", type=float, default=None,
                   help="speed estimate: host-to-device GB/s (default: the target's link, e.g. PCIe 5.0 x16 for h100)")
    p.add_argument("--host-hit-rate", type=float, default=None,
                   help="disk tier (--host-budget-gb): the host rows' hit rate (default: --trace replayed with the "
                        "rows as caches, else uniform routing, rows / experts)")
    p.add_argument("--disk-gbs", type=float, default=None,
                   help="disk tier (--host-budget-gb): GB/s the disk reads (default 2.0, assumed NVMe-class)")
    add_offload_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


def plan_from_args(args):
    """The Plan the parsed command line asks for (bench.plan runs this too, one process per plan)."""
    from jmoe.plan import plan_with_options

    if args.compile_cache is not None:
        # jax 0.10 cannot read back a compile-only executable ("PjRtCompiler must be constructed with a
        # Client to call DeserializeLoadedExecutable"), so the cache would only collect dead entries.
        raise JmoeError("--compile-cache / --no-compile-cache do not apply to python -m jmoe.plan: JAX's "
                        "persistent compilation cache cannot hold programs compiled for a GPU this machine "
                        "does not have; drop the flag")
    return plan_with_options(args.model, offload_options(args), target=args.target, batch=args.batch,
                             context=args.context, host_gb=args.host_gb, device_gb=args.device_gb,
                             compile=not args.no_compile, dtype=args.dtype, backend=args.backend,
                             hit_rate=args.hit_rate, trace=args.trace, host_link_gbs=args.host_link_gbs,
                             extrapolate_layers=args.extrapolate_layers, host_hit_rate=args.host_hit_rate,
                             disk_gbs=args.disk_gbs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        result = plan_from_args(args)
        print(result.to_json() if args.json else result.report())
        return 0 if result.fits else 1

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
