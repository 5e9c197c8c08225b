"""Benchmark HF -> Orbax conversion (peak RSS, wall time) and load time from Orbax vs safetensors.

Writes a Mixtral-shaped checkpoint with random bf16 weights, sharded, straight from NumPy with
safetensors; converts it with `python -m jmoe.convert` under `/usr/bin/time -v`; then loads it in
fresh processes with jmoe.loading.load_model (safetensors) and jmoe.orbax_store.restore_model
(Orbax, all on device, and with experts in pinned host memory). Prints a Markdown report and
deletes the work directory unless --keep.

    python -m bench.convert --workdir /tmp/jmoe_convert_bench [--layers 12] [--repeats 2] [--keep]
    python -m bench.convert --smoke   # one layer at smoke widths, one load each way, in a temporary directory
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from bench.helpers.common import add_smoke_argument, smoke_run, smoke_spec

# Mixtral layout at a reduced width: 8 experts, top-2, GQA 4:1. At 12 layers the weights are ~2.3 GB in bf16.
SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=4,
             num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
SHARD_BYTES = 500 * 2**20


def hf_tensors(num_layers: int, shape: dict):
    """(name, shape) of every tensor of the Mixtral checkpoint of `shape` (SHAPE's keys), in file order."""
    d, f, e, v = shape["hidden_size"], shape["intermediate_size"], shape["num_local_experts"], shape["vocab_size"]
    hd = d // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (v, d)
    for i in range(num_layers):
        pre = f"model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (d,)
        yield f"{pre}.post_attention_layernorm.weight", (d,)
        for proj, dims in (("q", (d, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, d))):
            yield f"{pre}.self_attn.{proj}_proj.weight", dims
        yield f"{pre}.block_sparse_moe.gate.weight", (e, d)
        for j in range(e):
            for w, dims in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
                yield f"{pre}.block_sparse_moe.experts.{j}.{w}.weight", dims
    yield "model.norm.weight", (d,)
    yield "lm_head.weight", (v, d)


def write_checkpoint(hf_dir: Path, num_layers: int, shape: dict) -> int:
    """Random bf16 weights in ~SHARD_BYTES shards with an index; returns the total bytes of tensor data."""
    from safetensors.numpy import save_file

    hf_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shards, current, current_bytes, total = [], {}, 0, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(current, str(hf_dir / name), metadata={"format": "pt"})
        shards.append((name, list(current)))

    for name, dims in hf_tensors(num_layers, shape):
        array = (rng.standard_normal(dims, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if current and current_bytes + array.nbytes > SHARD_BYTES:
            flush()
            current, current_bytes = {}, 0
        current[name] = array
        current_bytes += array.nbytes
        total += array.nbytes
    flush()
    count = len(shards)
    weight_map = {}
    for name, names in shards:
        final = name.replace(".safetensors", f"-of-{count:05d}.safetensors")
        (hf_dir / name).rename(hf_dir / final)
        weight_map.update({n: final for n in names})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    config = dict(shape, model_type="mixtral", architectures=["MixtralForCausalLM"], num_hidden_layers=num_layers,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
                  dtype="bfloat16", sliding_window=None)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return total


def timed(cmd: list[str]) -> dict:
    """Run cmd under /usr/bin/time -v; wall seconds, peak RSS and the command's last stdout line."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    seconds = sum(float(part) * 60**k for k, part in enumerate(reversed(wall.split(":"))))
    return {"wall_s": seconds, "peak_rss_gib": rss_kb / 2**20, "stdout": proc.stdout.strip().splitlines()[-1]}


def load_once(kind: str, hf_dir: str, orbax_dir: str) -> None:
    """Child process: load the model one way, print the seconds the load itself took."""
    import jax

    from jmoe.config import load_config
    from jmoe.checkpoint.loading import load_model
    from jmoe.checkpoint.orbax_store import restore_model
    from jmoe.memory import sharding_for

    cfg = load_config(hf_dir)
    start = time.perf_counter()
    if kind == "safetensors":
        module = load_model(Path(hf_dir), cfg, progress=False)
    elif kind == "orbax":
        module = restore_model(orbax_dir, cfg, progress=False)
    else:  # orbax, experts offloaded to pinned host memory
        module = restore_model(orbax_dir, cfg, progress=False,
                               sharding_of=lambda path: sharding_for("pinned_host" if "experts" in path else "device"))
    from flax import nnx
    jax.block_until_ready(nnx.state(module))
    print(f"{time.perf_counter() - start:.2f}")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_convert_bench"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="load timings per method (fresh process each)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir")
    add_smoke_argument(p)
    args = p.parse_args()
    with smoke_run(args) as smoke_dir:
        if args.smoke:
            args.workdir, args.layers, args.repeats = smoke_dir / "convert", 1, 1
        measure(args, smoke_spec(SHAPE) if args.smoke else SHAPE)


def measure(args, shape: dict) -> None:
    """Write, convert and load the checkpoint of `shape`; print the report."""
    if args.workdir.exists():
        sys.exit(f"{args.workdir} exists; remove it or pass another --workdir")
    hf_dir, orbax_dir = args.workdir / "hf", args.workdir / "orbax"
    try:
        start = time.perf_counter()
        data_bytes = write_checkpoint(hf_dir, args.layers, shape)
        print(f"wrote {data_bytes / 2**30:.2f} GiB of bf16 tensors in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        convert = timed([sys.executable, "-m", "jmoe.convert", str(hf_dir), str(orbax_dir), "--quiet"])
        loads = {kind: [timed([sys.executable, "-m", "bench.convert", "_load", kind, str(hf_dir), str(orbax_dir)])
                        for _ in range(args.repeats)]
                 for kind in ("safetensors", "orbax", "orbax_offload")}
        print(f"| HF checkpoint | {dir_bytes(hf_dir) / 2**30:.2f} GiB on disk, "
              f"{len(list(hf_dir.glob('*.safetensors')))} shards, {args.layers} layers, bf16 |")
        print(f"| Orbax checkpoint | {dir_bytes(orbax_dir) / 2**30:.2f} GiB on disk |")
        print(f"| convert | {convert['wall_s']:.1f} s wall, peak RSS {convert['peak_rss_gib']:.2f} GiB |")
        for kind, runs in loads.items():
            load_s = ", ".join(r["stdout"] for r in runs)
            walls = ", ".join(f"{r['wall_s']:.1f}" for r in runs)
            rss = ", ".join(f"{r['peak_rss_gib']:.2f}" for r in runs)
            print(f"| load {kind} | load {load_s} s; process wall {walls} s; peak RSS {rss} GiB |")
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_load"]:
        load_once(*sys.argv[2:5])
    else:
        main()
