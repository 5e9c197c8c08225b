"""Decoding a model larger than this machine's RAM through the disk tier (issue #31), against the llama.cpp way.

  python -m bench.disk_tier [--size-gb 30] [--budget-gb 4] [--tokens 8] [--read-ahead 2] [--rounds 2]
                            [--limits none] [--format safetensors|orbax] [--workdir DIR] [--clean]
  python -m bench.disk_tier --smoke          # a tiny checkpoint in a temporary directory, no result file

Writes once under --workdir a random bfloat16 checkpoint shaped to the GPT-OSS-20B routing trace (24 MoE layers
x 32 experts, top-4; Mixtral's tensor names, expert width chosen so the experts take --size-gb), then decodes
--tokens tokens with the routing forced from the trace's report split (`TraceRouting`), every engine in its own
process, alternated, the page cache dropped before each:
- `jmoe`: jmoe.load(cache=0, host_budget_gb=B, scratch_rows=1): the policy's rows in pinned host memory, the
  rest read by byte range (demand reads only), scratch slots for one row's misses; past the page cache or not as
  direct_reads=None decides in the run's memory limit (the `reads` column);
- `jmoe+ra`: the same with --read-ahead N, the history predictor fitted on the trace's tuning split;
- `mmap` (the llama.cpp way): the same experts read from np.memmaps of the same files (the page cache decides
  what stays), through the same engine at its smallest host tier (one row and one staged expert per layer), the
  same orientation and checks on the bytes.
With `--format orbax` every engine reads jmoe's Orbax conversion of that checkpoint instead (converted once; the
experts stored one per chunk as the engine holds them, so a read applies no orientation): jmoe through its Orbax
expert reader (TensorStore), `mmap` through np.memmaps of the same OCDBT data files at each expert's chunk.
Cache 0: on this CPU the device slots would be a second copy in the same RAM. With a limit, each process runs in
a memory cgroup (v1, needs root) of that size, page cache included: `budget` = --budget-gb + 2 GB (the issue's
resident-memory target) and + 4 GB did not hold the engines at commit 6b8e86a, when XLA:CPU still converted the
bfloat16 scratch and rows to float32 whole (since the FloatBits change jmoe peaked at 7.9 GB unlimited: rows,
the scratch's M = E slots and 1.1 GB of step temporaries; with scratch_rows=1, M = k, 7.0 GB;
bench/results/disk_tier.md),
so the default is `none`, the machine's RAM (the kernel's page cache then serves both engines' rereads: the
storage column counts what reached the disk); `budget` is --budget-gb + 8 GB for both, a number that many GB.
Reported: decode tokens/s, disk bytes per token (as the tier counts them, and as the kernel counts the
process's storage reads), time a step waited for the disk, peak RSS and the cgroup's peak, the disk's
bandwidth (one 64 MiB read at a time, and four in flight: this guest's disk gave 1.5-2x more so) and the bound the
faster implies.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.disk_reads import convert_once, drop_page_cache, parallel_gbs, sequential_gbs, write_checkpoint
from bench.helpers.common import add_smoke_argument, smoke_run, write_result

TRACE = "gptoss"
LAYERS, EXPERTS, TOP_K = 24, 32, 4  # the GPT-OSS-20B trace's
BASE_CONFIG = dict(model_type="mixtral", hidden_size=2048, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                   num_hidden_layers=LAYERS, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                   vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
# A smoke run's model: toy widths and the trace's first 2 layers (compiling the step is most of a smoke run, and each
# layer adds its own code; two have the first layer's read-ahead between steps and the next layer's inside the step)
SMOKE_CONFIG = {**BASE_CONFIG, "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 2, "head_dim": 16,
                "num_hidden_layers": 2}
ENGINES = ("mmap", "jmoe", "jmoe+ra")
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PARALLEL_READS = 4  # the disk's bandwidth with this many reads in flight (jmoe's reads: k per layer)
HEADROOM_GB = 2.0  # the resident-memory target: budget + 2 GB
LIMIT_HEADROOM_GB = 8.0  # the memory group's: the step's peak anonymous memory on XLA:CPU (below) plus page cache


def config_for(size_gb: float) -> dict:
    """BASE_CONFIG with the expert width (a multiple of 128) that makes the experts `size_gb` of bfloat16."""
    per_expert = size_gb * 1e9 / (LAYERS * EXPERTS)
    width = int(np.ceil(per_expert / (3 * BASE_CONFIG["hidden_size"] * 2) / 128) * 128)
    return {**BASE_CONFIG, "intermediate_size": width}


# ---- one engine's run (a child process) ----------------------------------------------------------------------

def memmap_reader_class():
    """ExpertReader whose bytes are views of np.memmaps of the checkpoint files (no copy: page faults through the
    page cache, as llama.cpp's mmap), everything after the bytes (checks, orientation) the same."""
    from jmoe.checkpoint.expert_reader import ExpertReader

    class MemmapExpertReader(ExpertReader):
        def _open_files(self):
            super()._open_files()
            self._maps = {path: np.memmap(path, np.uint8, "r") for path in self._fds}

        def _read_run(self, key, run):
            return self._maps[run.file][run.start:run.end]

    return MemmapExpertReader


def memmap_orbax_reader_class():
    """OrbaxExpertReader whose bytes are views of np.memmaps of the checkpoint's OCDBT data files (the llama.cpp way
    on jmoe's own format: no copy, the checks on the bytes fault the pages in and the step computes from them),
    everything after the bytes (shard index, file and CRC-32 checks) the same."""
    from jmoe.checkpoint.expert_reader_orbax import OrbaxExpertReader

    class MemmapOrbaxExpertReader(OrbaxExpertReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._maps = {path: np.memmap(path, np.uint8, "r") for path in self._fds}

        def _file_bytes(self, key, p, value):
            return self._maps[value.file][value.offset:value.offset + value.length]

    return MemmapOrbaxExpertReader


def storage_read_bytes() -> int:
    """Bytes this process caused to be read from storage (the kernel's count: page cache hits excluded)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def run_engine(args) -> dict:
    import jmoe
    from jmoe.checkpoint import expert_reader_orbax
    from jmoe.checkpoint.orbax_store import is_orbax_checkpoint
    from jmoe.decode.sampling import SamplingParams
    from jmoe.offload.host_tier import host_budget_gb_holding
    from jmoe.traces.forced_routing import TraceRouting
    from jmoe.traces.load import load_trace, split_trace

    split = split_trace(load_trace(TRACE), None)
    rows = split["eval_ids"][:args.tokens, :args.layers]
    # One decoded row: scratch slots for its top-k misses (the default 8 rows' 32 = E slots were 1.26 GB here).
    options = {"cache": 0, "host_budget_gb": args.budget_gb, "scratch_rows": 1, "check_memory": False,
               "progress": False}
    if args.engine == "jmoe+ra":
        options.update(prefetch_trace=split["tune_ids"][:, :args.layers], read_ahead=args.read_ahead)
    if args.engine == "mmap":
        reader = memmap_orbax_reader_class() if is_orbax_checkpoint(args.directory) else memmap_reader_class()
        expert_reader_orbax.open_expert_reader = lambda model_dir, cfg, **kw: reader(model_dir, cfg, **kw)
        layer_bytes = args.layers * args.expert_bytes
        # the smallest host tier; its memmaps read through the page cache
        options.update(host_budget_gb=host_budget_gb_holding(1, layer_bytes), direct_reads=False)
    began = time.perf_counter()
    with jmoe.load(args.directory, **options) as model:
        loaded = time.perf_counter() - began
        routing = TraceRouting(rows, prompt_len=1, config=model.config)
        read_before = storage_read_bytes()
        result = model.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing)
        storage = storage_read_bytes() - read_before
        stats = model.stats()
        tier = model.engine.tier
        totals = {key: sum(layer[key] for layer in stats)
                  for key in ("disk_reads", "disk_bytes", "read_ahead_reads", "read_ahead_used")}
        return {"engine": args.engine, "load_seconds": loaded, "decode_seconds": result.decode_seconds,
                "decode_steps": result.decode_steps, "prefill_seconds": result.prefill_seconds,
                "wait_seconds": tier.wait_seconds, "storage_bytes": storage, "host_rows": tier.rows,
                "direct_reads": tier.reader.direct,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **totals}


# ---- the parent: checkpoint, runs, report --------------------------------------------------------------------

class MemoryLimit:
    """A cgroup v1 memory group of `limit_bytes` (page cache included) a child joins; None where this process may
    not make one (not root, no v1 memory controller)."""

    def __init__(self, limit_bytes: int | None):
        self.path = None
        if limit_bytes is None:
            return
        path = CGROUP_ROOT / f"jmoe_disk_tier_{os.getpid()}"
        try:
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            return
        self.path = path

    def join(self, pid: int) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(pid))

    def peak_bytes(self) -> int | None:
        return None if self.path is None else int((self.path / "memory.max_usage_in_bytes").read_text())

    def close(self) -> None:
        if self.path is not None:
            self.path.rmdir()


def child_run(args, engine: str, limit_gb: float | None, expert_bytes: int, layers: int) -> dict:
    command = [sys.executable, "-m", "bench.disk_tier", "--engine", engine, "--directory", str(args.directory),
               "--budget-gb", str(args.budget_gb), "--tokens", str(args.tokens), "--read-ahead", str(args.read_ahead),
               "--expert-bytes", str(expert_bytes), "--layers", str(layers)]
    limit = MemoryLimit(None if limit_gb is None else int(limit_gb * 1e9))
    try:
        # The child waits on stdin until it is in the cgroup, so that all its memory is counted there.
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        limit.join(child.pid)
        out, _ = child.communicate("go\n")
        if child.returncode:
            raise RuntimeError(f"{engine} (limit {limit_gb} GB) exited with {child.returncode}"
                               + (" (killed: over the memory limit?)" if child.returncode < 0 else ""))
        result = json.loads(out.strip().splitlines()[-1])
        result.update(limit_gb=limit_gb, limited=limit.path is not None, cgroup_peak_bytes=limit.peak_bytes())
        return result
    finally:
        limit.close()


def checkpoint_data_files(directory: Path) -> list[Path]:
    """The files holding a checkpoint's tensors: safetensors shards, or an Orbax checkpoint's OCDBT data files."""
    found = sorted(directory.glob("*.safetensors")) or sorted(p for p in directory.rglob("d/*") if p.is_file())
    if not found:
        raise RuntimeError(f"{directory}: no safetensors files and no OCDBT data files")
    return found


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(args, cfg, expert_bytes: int, checkpoint_gb: float, disk: tuple[float, float], runs: dict,
           dropped: bool, load: tuple) -> str:
    lines = [
        f"Checkpoint: {checkpoint_gb:.1f} GB of random bfloat16, {args.format} format, at `{args.directory}` "
        f"({cfg.num_layers} MoE layers x "
        f"{cfg.num_experts} experts of {expert_bytes / 1e6:.1f} MB, top-{cfg.num_experts_per_tok}: hidden "
        f"{cfg.hidden_size}, expert width {cfg.expert_intermediate_size}); routing forced from the {TRACE} trace's "
        f"report split, {args.tokens} tokens (1 prompt token, {args.tokens - 1} decode steps); host budget "
        f"{args.budget_gb} GB, cache 0, read-ahead {args.read_ahead} experts of the next layer for `jmoe+ra`.",
        f"Page cache dropped before every run: {'yes' if dropped else 'NO (no permission)'}. Load average at the "
        f"start: {' '.join(load)}. Medians of {args.rounds} rounds, engines alternated, each in its own process.",
        f"Disk: read {disk[0]:.2f} GB/s one 64 MiB pread at a time, {disk[1]:.2f} GB/s with {PARALLEL_READS} in "
        f"flight (page cache dropped); the bound uses the faster.",
        "",
        "| memory limit | engine | reads | tokens/s | disk MB/token (tier) | storage MB/token (kernel) | "
        "waited s/token | bound tokens/s | share of bound | peak RSS GB | cgroup peak GB | host rows | "
        "read-ahead used/read |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (limit, engine), engine_runs in runs.items():
        steps = median(engine_runs, "decode_steps")
        rate = steps / median(engine_runs, "decode_seconds")
        storage = median(engine_runs, "storage_bytes") / (steps + 1)  # the prompt step reads too
        tier_bytes = median(engine_runs, "disk_bytes") / (steps + 1)
        bound = max(disk) * 1e9 / storage if storage else float("inf")
        peak = [r["cgroup_peak_bytes"] for r in engine_runs if r["cgroup_peak_bytes"] is not None]
        limit_text = "machine RAM" if limit is None else (f"{limit:.0f} GB" if all(r["limited"] for r in engine_runs)
                                                          else f"{limit:.0f} GB NOT APPLIED (no cgroup)")
        ahead = (f"{median(engine_runs, 'read_ahead_used'):.0f}/{median(engine_runs, 'read_ahead_reads'):.0f}"
                 if engine == "jmoe+ra" else "-")
        reads = "mmap" if engine == "mmap" else "/".join(sorted({"direct" if r["direct_reads"] else "buffered"
                                                                for r in engine_runs}))
        lines.append(f"| {limit_text} | {engine} | {reads} | {rate:.3f} | {tier_bytes / 1e6:.0f} | "
                     f"{storage / 1e6:.0f} | "
                     f"{median(engine_runs, 'wait_seconds') / steps:.2f} | {bound:.3f} | {100 * rate / bound:.0f}% | "
                     f"{median(engine_runs, 'peak_rss_bytes') / 1e9:.2f} | "
                     f"{statistics.median(peak) / 1e9 if peak else float('nan'):.2f} | "
                     f"{engine_runs[0]['host_rows']} | {ahead} |")
    target = args.budget_gb + HEADROOM_GB
    peaks = ", ".join(f"{engine} {median(engine_runs, 'peak_rss_bytes') / 1e9:.2f} GB"
                      f"{'' if limit is None else f' (limit {limit:.0f} GB)'}"
                      for (limit, engine), engine_runs in runs.items() if engine != "mmap")
    lines += ["", f"Resident-memory target, peak RSS <= budget + {HEADROOM_GB:g} GB = {target:g} GB: {peaks}. (The mmap "
                  f"engine's RSS counts the checkpoint pages it has mapped, which the kernel can take back.)"]
    lines += ["", "Per limit: jmoe / mmap tokens/s, and the share of the demand-only wait read-ahead hid:", ""]
    for limit in dict.fromkeys(limit for limit, _ in runs):
        rate = {engine: median(runs[limit, engine], "decode_steps") / median(runs[limit, engine], "decode_seconds")
                for engine in ENGINES if (limit, engine) in runs}
        wait = {engine: median(runs[limit, engine], "wait_seconds") for engine in rate}
        parts = [f"{engine} {rate[engine] / rate['mmap']:.2f}x mmap" for engine in ("jmoe", "jmoe+ra")
                 if engine in rate and "mmap" in rate]
        if "jmoe" in wait and "jmoe+ra" in wait and wait["jmoe"]:
            parts.append(f"read-ahead hid {100 * (1 - wait['jmoe+ra'] / wait['jmoe']):.0f}% of jmoe's wait")
        lines.append(f"- {'machine RAM' if limit is None else f'{limit:.0f} GB'}: {'; '.join(parts)}")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=30.0, help="the checkpoint's experts, GB")
    parser.add_argument("--budget-gb", type=float, default=4.0, help="jmoe's host budget")
    parser.add_argument("--tokens", type=int, default=8, help="trace rows decoded (the first is the prompt)")
    # 2: 4 read 2980 experts ahead to spare 1470 demand reads over 32 tokens, 2 read 1490 for 996
    # (bench/results/disk_tier_orbax.md)
    parser.add_argument("--read-ahead", type=int, default=2, help="experts of the next layer read ahead by jmoe+ra")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limits", type=lambda s: s.split(","), default=["none"],
                        help="memory limits to run under: budget (= budget + 8 GB), none, or a number of GB")
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES))
    parser.add_argument("--workdir", type=Path, default=Path("/work/jmoe_bench_disk_tier"))
    parser.add_argument("--format", choices=("safetensors", "orbax"), default="safetensors",
                        help="the checkpoint every engine reads: the written safetensors, or jmoe's Orbax conversion "
                             "of it (converted once under --workdir; its experts stored as the engine holds them)")
    parser.add_argument("--clean", action="store_true", help="remove the checkpoint(s) afterwards")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # a child's run
    parser.add_argument("--directory", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--expert-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)  # the model's MoE layers: the trace's first
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.engine:
        sys.stdin.readline()  # in the memory group now
        print(json.dumps(run_engine(args)), flush=True)
        return
    from jmoe.config import parse_config

    with smoke_run(args):
        load = tuple(open("/proc/loadavg").read().split()[:3])
        config = SMOKE_CONFIG if args.smoke else config_for(args.size_gb)
        written = write_checkpoint(args.workdir / "checkpoint", config)
        args.directory = written if args.format == "safetensors" else convert_once(written, args.workdir / "orbax")
        cfg = parse_config(json.loads((written / "config.json").read_text()))
        expert_bytes = 3 * cfg.hidden_size * cfg.expert_intermediate_size * 2
        data_files = checkpoint_data_files(args.directory)
        checkpoint_gb = sum(p.stat().st_size for p in data_files) / 1e9
        if args.smoke:  # the two readers and read-ahead, briefly
            args.budget_gb, args.tokens, args.rounds = 6.5 * cfg.num_moe_layers * expert_bytes / 1e9, 4, 1
            args.engines = ["mmap", "jmoe+ra"]
        dropped = not args.smoke and drop_page_cache()
        largest = sorted(data_files, key=lambda p: p.stat().st_size, reverse=True)
        sequential = sequential_gbs(largest[0])
        dropped &= args.smoke or drop_page_cache()
        disk = (sequential, parallel_gbs(largest[min(1, len(largest) - 1)], PARALLEL_READS))
        limits = [None if limit == "none" else args.budget_gb + LIMIT_HEADROOM_GB if limit == "budget" else float(limit)
                  for limit in (["none"] if args.smoke else args.limits)]
        runs: dict[tuple, list[dict]] = {}
        for _ in range(args.rounds):
            for limit in limits:
                for engine in args.engines:
                    dropped &= args.smoke or drop_page_cache()
                    result = child_run(args, engine, limit, expert_bytes, cfg.num_moe_layers)
                    runs.setdefault((limit, engine), []).append(result)
                    print(json.dumps(result), flush=True)
        body = report(args, cfg, expert_bytes, checkpoint_gb, disk, runs, dropped, load)
        print(body)
        name = "disk_tier.md" if args.format == "safetensors" else f"disk_tier_{args.format}.md"
        path = write_result(name, f"Decoding through the disk tier against memory-mapped experts ({args.format})",
                            body)
        print(f"wrote {path}")
        if args.clean:
            for directory in (written, args.workdir / "orbax"):
                shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
