"""How fast experts come off this machine's disk through jmoe's ExpertReader (issue #31's disk tier).

  python -m bench.disk_reads [--gb 4] [--threads 1,2,4,8,16] [--experts 24] [--formats safetensors,orbax]
                              [--workdir DIR] [--clean]
  python -m bench.disk_reads --smoke          # a tiny checkpoint in a temporary directory, no result file

Writes a random bfloat16 checkpoint with DeepSeek-V3 / Kimi-K2-sized routed experts (hidden 7168, expert width
2048: 88 MB per expert as three tensors; Mixtral's names, one safetensors shard per layer, written layer by layer
so memory holds one layer) once under --workdir, converted once to jmoe's Orbax format (each expert its own chunk,
stored as jmoe holds it), then, with the page cache dropped before every run:
- the disk's sequential read bandwidth (one 64 MiB pread after another through a shard: the bound an expert
  read can approach);
- each format's expert reader (`open_expert_reader`: safetensors by byte range, Orbax through TensorStore) reading
  --experts random (layer, expert) pairs with 1, 2, ... threads: GB/s including what a read costs on the CPU
  (safetensors: transposing into jmoe's orientation, as loading does; Orbax: a copy), ms per expert.
Dropping the page cache needs root (`/proc/sys/vm/drop_caches`); where it fails the report says so, and its
numbers are then partly the page cache's. --clean removes the checkpoints afterwards.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from bench.helpers.common import add_smoke_argument, smoke_run, write_result

# DeepSeek-V3 / Kimi-K2's routed expert shape; a small attention and vocabulary (the reads are experts only).
EXPERT_CONFIG = dict(model_type="mixtral", hidden_size=7168, intermediate_size=2048, num_local_experts=16,
                     num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                     vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMOKE_CONFIG = {**EXPERT_CONFIG, "hidden_size": 64, "intermediate_size": 32, "num_local_experts": 4, "head_dim": 16}
SEQUENTIAL_CHUNK = 64 * 2**20


def layers_for(config: dict, gigabytes: float) -> int:
    expert = 3 * config["hidden_size"] * config["intermediate_size"] * 2  # bfloat16
    return max(1, round(gigabytes * 1e9 / (expert * config["num_local_experts"])))


def write_checkpoint(directory: Path, config: dict, seed: int = 0) -> Path:
    """A random bfloat16 checkpoint, one shard per layer (plus one for embeddings and head), with its index.
    Reused when its config.json is there (written last)."""
    from safetensors.numpy import save_file

    from jmoe.checkpoint.hf_layout import expected_tensors
    from jmoe.config import parse_config

    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": "bfloat16"}
    by_shard: dict[str, dict[str, tuple]] = {}
    for name, target in expected_tensors(parse_config(config)).items():
        parts = name.split(".")
        shard = f"layer-{int(parts[2]):05d}" if parts[:2] == ["model", "layers"] else "other"
        by_shard.setdefault(shard, {})[name] = target.hf_shape
    rng = np.random.default_rng(seed)
    weight_map = {}
    for shard, shapes in sorted(by_shard.items()):
        # Random normal values: finite, so the same files serve a decode later.
        tensors = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
                   for name, shape in shapes.items()}
        save_file(tensors, str(directory / f"{shard}.safetensors"), metadata={"format": "pt"})
        weight_map.update({name: f"{shard}.safetensors" for name in tensors})
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def drop_page_cache() -> bool:
    """Write back and drop the page cache; False where this process may not (not root, or a container)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def sequential_gbs(path: Path) -> float:
    """One 64 MiB pread after another through `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size, offset = os.fstat(fd).st_size, 0
        began = time.perf_counter()
        while offset < size:
            offset += len(os.pread(fd, SEQUENTIAL_CHUNK, offset))
        return size / (time.perf_counter() - began) / 1e9
    finally:
        os.close(fd)


def parallel_gbs(path: Path, threads: int) -> float:
    """64 MiB preads through `path`, `threads` of them in flight (the chunks taken in order)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offsets = range(0, size, SEQUENTIAL_CHUNK)
        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            read = sum(pool.map(lambda offset: len(os.pread(fd, SEQUENTIAL_CHUNK, offset)), offsets))
        return read / (time.perf_counter() - began) / 1e9
    finally:
        os.close(fd)


def reader_run(directory: Path, cfg, pairs: list[tuple[int, int]], threads: int) -> dict:
    """Read every (layer, expert) of `pairs` with `threads` threads of the directory format's reader, all submitted
    at once."""
    from jmoe.checkpoint.expert_reader_orbax import open_expert_reader

    with open_expert_reader(directory, cfg, threads=threads) as reader:
        total = sum(reader.checkpoint_bytes(layer, expert) for layer, expert in pairs)
        began = time.perf_counter()
        finished = []

        def done(_):
            finished.append(time.perf_counter())

        futures = [reader.submit(layer, expert) for layer, expert in pairs]
        for future in futures:
            future.add_done_callback(done)
        for future in futures:
            future.result()
        seconds = time.perf_counter() - began
    gaps = np.diff([began, *sorted(finished)])
    return {"threads": threads, "bytes": total, "seconds": seconds, "gbs": total / seconds / 1e9,
            "ms_per_expert": 1e3 * seconds / len(pairs), "median_gap_ms": 1e3 * float(np.median(gaps))}


def report(args, sequential: list[float], runs: dict[str, list[dict]], dropped: bool, checkpoint_gb: float, cfg,
           expert_mb: float, load: tuple, count: int) -> str:
    cache_note = ("yes" if dropped else "no (a smoke run leaves it alone)" if args.smoke
                  else "NO (no permission): the numbers are partly the page cache's")
    seq = statistics.median(sequential)
    lines = [
        f"Checkpoint: {checkpoint_gb:.1f} GB of random bfloat16, {cfg.num_layers} layers x {cfg.num_experts} experts "
        f"of {expert_mb:.0f} MB (hidden {cfg.hidden_size}, expert width {cfg.expert_intermediate_size}: DeepSeek-V3 / "
        f"Kimi-K2's routed experts), one safetensors shard per layer, and the same converted to jmoe's Orbax format, "
        f"under `{args.workdir}`.",
        f"Page cache dropped before every run: {cache_note}. Load average at the start: {' '.join(load)}.",
        "",
        f"Sequential read (64 MiB preads through one {expert_mb * cfg.num_experts / 1e3:.1f} GB shard), "
        f"{len(sequential)} runs: median {seq:.2f} GB/s ({', '.join(f'{v:.2f}' for v in sequential)}).",
        "",
        f"Expert readers, {count} random (layer, expert) reads submitted at once, one run per format and thread count "
        f"(GB/s counts the checkpoint bytes; a safetensors read also transposes into jmoe's orientation, as loading "
        f"does; an Orbax read is stored as jmoe holds it):",
        "",
        "| format | threads | GB/s | share of sequential | ms per expert | median gap between completions (ms) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {fmt} | {r['threads']} | {r['gbs']:.2f} | {100 * r['gbs'] / seq:.0f}% | {r['ms_per_expert']:.1f} | "
              f"{r['median_gap_ms']:.1f} |" for fmt, format_runs in runs.items() for r in format_runs]
    lines.append("")
    for fmt, format_runs in runs.items():
        best = max(format_runs, key=lambda r: r["gbs"])
        lines.append(f"Best {fmt}: {best['threads']} threads, {best['gbs']:.2f} GB/s = "
                     f"{expert_mb / 1e3 / best['gbs'] * 1e3:.0f} ms per {expert_mb:.0f} MB expert.")
    lines += ["", "A decode token that must read r experts from disk waits at least r x the best time per expert "
                  "(the disk tier's bound on this machine).", ""]
    return "\n".join(lines)


def convert_once(hf_dir: Path, out_dir: Path) -> Path:
    from jmoe.checkpoint.convert import convert_checkpoint
    from jmoe.checkpoint.orbax_store import MANIFEST

    if not (out_dir / MANIFEST).is_file():
        convert_checkpoint(hf_dir, out_dir, overwrite=True, progress=False)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=4.0, help="size of the checkpoint's experts")
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--experts", type=int, default=24, help="experts read per run")
    parser.add_argument("--formats", type=lambda s: s.split(","), default=["safetensors", "orbax"])
    parser.add_argument("--sequential-runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench_disk"))
    parser.add_argument("--clean", action="store_true", help="remove the checkpoints afterwards")
    parser.add_argument("--seed", type=int, default=0)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    from jmoe.config import parse_config

    with smoke_run(args):
        config = SMOKE_CONFIG if args.smoke else EXPERT_CONFIG
        threads = [1, 2] if args.smoke else args.threads
        load = tuple(open("/proc/loadavg").read().split()[:3])
        config = {**config, "num_hidden_layers": 2 if args.smoke else layers_for(config, args.gb)}
        directory = write_checkpoint(args.workdir / "checkpoint", config, args.seed)
        directories = {"safetensors": directory, "orbax": convert_once(directory, args.workdir / "orbax")}
        cfg = parse_config(json.loads((directory / "config.json").read_text()))
        shards = sorted(directory.glob("layer-*.safetensors"))
        checkpoint_gb = sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e9
        expert_mb = 3 * cfg.hidden_size * cfg.expert_intermediate_size * 2 / 1e6
        rng = np.random.default_rng(args.seed)
        layers = list(cfg.moe_layer_indices)
        dropped = True
        sequential = []
        for run in range(1 if args.smoke else args.sequential_runs):
            dropped &= not args.smoke and drop_page_cache()  # a smoke run leaves the machine's cache alone
            sequential.append(sequential_gbs(shards[run % len(shards)]))
        count = min(args.experts, len(layers) * cfg.num_experts)
        runs: dict[str, list[dict]] = {fmt: [] for fmt in args.formats}
        for n in threads:  # formats alternate at each thread count
            chosen = rng.choice(len(layers) * cfg.num_experts, count, replace=False)
            pairs = [(layers[i // cfg.num_experts], int(i % cfg.num_experts)) for i in chosen]
            for fmt in args.formats:
                dropped &= not args.smoke and drop_page_cache()
                runs[fmt].append(reader_run(directories[fmt], cfg, pairs, n))
                print(f"{fmt}, {n} threads: {runs[fmt][-1]['gbs']:.2f} GB/s", flush=True)
        body = report(args, sequential, runs, dropped, checkpoint_gb, cfg, expert_mb, load, count)
        print(body)
        path = write_result("disk_reads.md", "Experts read from disk by jmoe's expert readers", body)
        print(f"wrote {path}")
        if args.clean:
            for kept in directories.values():
                shutil.rmtree(kept)


if __name__ == "__main__":
    main()
