"""One command for a lent GPU: check jmoe's numerics on the device and measure what a CPU cannot.

  python -m bench.gpu_check                  # on the GPU: about 9 minutes -> bench/results/gpu_check_<device>.md/.json
  python -m bench.gpu_check --small          # the same code paths at tiny shapes (runs on CPU; the suite does this)
  python -m bench.gpu_check --smoke          # --small, fewer items, in a temporary directory, no result file

On a lent machine nothing is installed: run from the repository root after `ln -sfn ../kernels jmoe/kernels`
(the package maps jmoe.kernels to kernels/), carrying jax-triton's wheel (bench/results/gpu_check_*.md says how).

Sections, in order (each with a share of the time budget plus what earlier ones left; what that or the whole
budget does not reach is recorded as "not run: out of time", never skipped silently):
  environment  JAX version, devices, which optional packages the image has (jax-triton, torch, ...)
  kernels      every kernel backend in every expert format against `reference` (bench.gpu.numerics), and the decode
               step's bookkeeping kernels (the choice of experts, miss mode "fetch"'s plan), its attention, norm and
               large projections' kernels against the XLA computations they replace (bench.gpu.bookkeeping,
               bench.gpu.decode_attention, bench.gpu.norm, bench.gpu.projection)
  families     every family's logits on the device against JAX's CPU backend (a child process)
  offload      tokens and logits at caches 0, 2, E-1, E (fetch, host and direct misses), the disk tier (host rows),
               prefetch, layer groups
  bandwidth    host-to-device GB/s: in-program expert copies (unrolled, a data-dependent loop, and the expert-copy
               kernel every step's copies take on a GPU, at three chunk sizes, checked against the loop),
               jax.device_put, a plain 1 GiB copy
  decode       tokens/s of Mixtral- and DeepSeek-shaped bf16 models of a few GB, resident and at caches (the
               smallest also with misses computed on the host and read in place by the expert kernel), with
               device memory held against jmoe.plan and experts checked to be in pinned host memory, and the
               first model's disk tier on its Orbax conversion (half the experts in host rows: the in-step
               reads' cost, traced)
The report is rewritten after every section (sections not reached marked so): a run killed at the lent
machine's time limit keeps what it measured. Failed checks are logged as their section ends. Each item is named
on stderr before it runs, so one that aborts the process (an XLA check failure) is known; `--exclude TEXT` then
records the items whose name contains TEXT as not run, and a rerun reaches the rest.
It builds its own random-weight checkpoints under --workdir (bench.gpu.models) and needs only the image's
packages: a missing one (jax-triton) is reported as a check not run. Exit status 0 when no check failed.
--small (and --smoke) use one kernel shape, two of the families (bench.gpu.numerics.SMALL_FAMILIES), models of
smoke size (bench.helpers.common.SMOKE_SIZES) and two caches per speed model, and run every kernel and family check
whatever the budget; they compile one program per expert format for all its kernel backends, and write their models'
configs without transformers (bench.gpu.models.model_config). A smoke run also leaves out, as --exclude does, the
items SMOKE_EXCLUDED names (recorded as not run): it keeps two offload settings (one with the disk tier) and the second
speed model resident only, the items left out sharing their code paths; its 90 s budget is a bound a quiet machine
does not reach. tests/test_gpu_check.py runs the smoke run and reads its report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from bench.gpu.results import NOT_REACHED, Budget, SectionResult, markdown, summary
from bench.helpers.common import add_smoke_argument, error_text, smoke_run, write_result

BUDGET_SECONDS = 540  # 9 minutes: a lent machine allows 10 per command
SMOKE_BUDGET_SECONDS = 90  # a bound: on a quiet machine a smoke run ends sooner, having run what it chose
# What a smoke run leaves out, as --exclude would: every item whose code path another item runs (the settings differ in
# jmoe.load's options only, and the suite tests the offload engine in each: tests/test_offload.py, test_disk_tier.py,
# test_layer_groups.py, ...; on a CPU, miss mode "direct" runs "host"'s code). It keeps one plain and one disk-tier
# offload setting, and the second decode model resident.
SMOKE_EXCLUDED = ("cache 0,", "miss fetch", "miss direct", "misses ", "cache 7,", "cache 8,", "prefetch 2",
                  "layer groups", "deepseek_v3, cache")
# Each section's share of the budget, plus what earlier ones left unused (the whole budget bounds the run).
SHARES = {"environment": 0.02, "kernels": 0.15, "families": 0.12, "offload": 0.2, "bandwidth": 0.06, "decode": 0.45}
OPTIONAL_PACKAGES = ("jax_triton", "triton", "torch", "transformers", "safetensors", "orbax", "jax_plugins")


def environment(args, budget: Budget, log) -> SectionResult:
    import jax

    result = SectionResult()
    device = jax.devices()[0]
    result.measurements.update({"jax": jax.__version__, "backend": jax.default_backend(),
                                "device": device.device_kind, "devices": jax.device_count(),
                                "memory kinds": ", ".join(sorted(m.kind for m in device.addressable_memories()))})
    stats = device.memory_stats()
    result.measurements["device bytes_limit"] = stats.get("bytes_limit", "unknown") if stats else "no memory_stats()"
    for package in OPTIONAL_PACKAGES:
        result.measurements[f"package {package}"] = ("present" if importlib.util.find_spec(package) is not None
                                                     else "missing")
    return result


def section_functions(args) -> dict:
    from bench.gpu import numerics, speed

    measured = {}

    def bandwidth(args, budget, log):
        measured["bandwidth"] = speed.bandwidth(args.workdir, args.small, budget, log)
        return measured["bandwidth"]

    def decode(args, budget, log):
        copy_gbs = speed.measured_copy_gbs(measured["bandwidth"]) if "bandwidth" in measured else None
        return speed.decode_speed(args.workdir, args.small, args.tokens, copy_gbs, budget, log)

    return {"environment": environment,
            "kernels": lambda args, budget, log: numerics.kernels(args.small, budget, log),
            "families": lambda args, budget, log: numerics.families(args.workdir, args.small, budget, log),
            "offload": lambda args, budget, log: numerics.offload(args.workdir, args.small, budget, log),
            "bandwidth": bandwidth, "decode": decode}


def run_sections(args, after_section=lambda results: None) -> dict[str, SectionResult]:
    """Each asked-for section in order; `after_section(results)` after each, the sections not reached yet marked so
    (a report written there survives a run killed at the lent machine's time limit)."""
    budget = Budget(args.budget_s, excluded=tuple(args.exclude))

    def log(message):
        print(f"[{budget.elapsed():5.0f} s] {message}", file=sys.stderr, flush=True)

    results = {}
    for name, fn in section_functions(args).items():
        if name not in args.sections:
            continue
        if budget.elapsed() >= budget.seconds:
            results[name] = SectionResult(status="not run: out of time")
            continue
        budget.start_section(SHARES[name])
        began = time.perf_counter()
        try:
            results[name] = fn(args, budget, log)
        except Exception as error:  # one section's failure must not cost the others their turn
            import traceback

            traceback.print_exc()
            results[name] = SectionResult(status=f"failed: {error_text(error)}")
        results[name].seconds = time.perf_counter() - began
        checks = results[name].checks
        log(f"{name}: {results[name].status}; checks: {sum(c['passed'] is True for c in checks)} passed, "
            f"{sum(c['passed'] is False for c in checks)} failed, {sum(c['passed'] is None for c in checks)} not run")
        for c in checks:
            if c["passed"] is False:
                log(f"  FAIL {c['name']}: {c['detail']}")
        pending = {n: SectionResult(status=NOT_REACHED) for n in args.sections if n not in results}
        after_section({**results, **pending})
    return results


def write_report(args, results: dict[str, SectionResult]) -> Path:
    import jax

    device = jax.devices()[0].device_kind.replace(" ", "_").lower()
    name = f"gpu_check_{'small_' if args.small else ''}{device}"
    mode = "small (tiny shapes: checks the logic, measures nothing meaningful)" if args.small else "full"
    header = (f"Mode: {mode}; time budget {args.budget_s:.0f} s. Kernel numerics, family logits against the "
              f"CPU, the offload engine against all-resident, host-to-device bandwidth and decode speed on "
              f"`{jax.devices()[0].device_kind}` (jax {jax.__version__}).")
    path = write_result(f"{name}.md", "GPU check", markdown(results, header))
    payload = {"mode": "small" if args.small else "full", "budget_s": args.budget_s, "summary": summary(results),
               "sections": {n: r.as_dict() for n, r in results.items()}}
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes: the same code paths, runs on CPU")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock budget (default {BUDGET_SECONDS} s; {SMOKE_BUDGET_SECONDS} s with --smoke)")
    p.add_argument("--sections", default=",".join(SHARES), help=f"comma-separated subset of {', '.join(SHARES)}")
    p.add_argument("--exclude", action="append", default=[], metavar="TEXT",
                   help="record the checks and decode settings whose name contains TEXT as not run (e.g. one that "
                        "aborts the process on this image, so that a rerun reaches the rest); repeatable")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens per measurement (default 64; small 4)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_gpu_check"),
                   help="where the random checkpoints are written (reused by later runs)")
    p.add_argument("--cpu-reference", type=Path, default=None, help=argparse.SUPPRESS)  # the families' child
    add_smoke_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cpu_reference is not None:
        from bench.gpu.numerics import cpu_logits, family_directories

        # The parent wrote the checkpoints: this process needs no transformers (its import is seconds of a smoke run).
        cpu_logits(family_directories(args.cpu_reference, args.small), args.cpu_reference / "cpu_logits.npz")
        return 0
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(args.sections) - set(SHARES))
    if unknown:
        raise SystemExit(f"error: unknown sections {unknown}; expected a subset of {', '.join(SHARES)}")
    args.small = args.small or args.smoke
    args.exclude += SMOKE_EXCLUDED if args.smoke else ()
    args.budget_s = args.budget_s if args.budget_s is not None else (
        SMOKE_BUDGET_SECONDS if args.smoke else BUDGET_SECONDS)
    args.tokens = args.tokens or (4 if args.small else 64)
    with smoke_run(args):
        results = run_sections(args, after_section=lambda partial: write_report(args, partial))
        path = write_report(args, results)
        print(path.with_suffix(".json").read_text() if args.smoke else path)
    return 1 if summary(results)["failed"] or any(r.status.startswith("failed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
