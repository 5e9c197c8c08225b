"""Held-out perplexity, per-layer routing skew and greedy samples of checkpoints/default.

    python -m checkpoints.recipe.evaluate --work /tmp/jmoe-default

Perplexity is per token with `jmoe.load(...).logits` (the shipped dtype) on the held-out files'
token stream cut into non-overlapping windows of --window tokens; each window predicts its tokens
2..window from the ones before. Routing skew counts the (token, choice) pairs each expert receives on
the same windows, from the module's forward (which returns the expert ids). Samples are greedy, from
the command line exactly as a user runs it. Writes evaluation.json into the model directory.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmoe
from jmoe.model import empty_kv_cache

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def ", "class Parser:\n    def __init__(self", "import os\nimport sys\n\n"]


def held_out_windows(work: Path, window: int) -> np.ndarray:
    stream = np.load(work / "validation_tokens.npy").astype(np.int32)
    n = stream.size // window
    return stream[:n * window].reshape(n, window)


def perplexity(model: jmoe.Model, windows: np.ndarray, batch: int) -> dict:
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        rows = windows[i:i + batch]
        logits = model.logits(rows)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], jnp.asarray(rows[:, 1:]))
        total += float(jnp.sum(nll))
        count += nll.size
    return {"tokens_scored": count, "nll_per_token": total / count, "perplexity": math.exp(total / count)}


def routing_skew(model: jmoe.Model, windows: np.ndarray, batch: int) -> list[dict]:
    module, cfg = model.module(), model.config
    b, t = batch, windows.shape[1]

    @jax.jit
    def route(tokens):
        return module(tokens, empty_kv_cache(cfg, b, t, model.kv_dtype), 0, jnp.zeros(b, jnp.int32),
                      backend=model.engine.backend).routing

    counts = np.zeros((cfg.num_moe_layers, cfg.num_experts), np.int64)
    for i in range(0, len(windows) - b + 1, b):
        ids = np.asarray(route(jnp.asarray(windows[i:i + b])))
        for layer in range(cfg.num_moe_layers):
            counts[layer] += np.bincount(ids[layer].reshape(-1), minlength=cfg.num_experts)
    out = []
    for layer, c in zip(cfg.moe_layer_indices, counts):
        share = c / c.sum()
        nz = share[share > 0]
        out.append({"layer": layer, "busiest_share": float(share.max()), "quietest_share": float(share.min()),
                    "load_entropy_bits": float(-(nz * np.log2(nz)).sum()),
                    "max_entropy_bits": math.log2(cfg.num_experts), "pairs": int(c.sum())})
    return out


def cli_sample(prompt: str, max_new_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "jmoe.generate", "--prompt", prompt, "--max-new-tokens", str(max_new_tokens),
           "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    return {"prompt": prompt, "max_new_tokens": max_new_tokens, "text": report["text"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="the training work directory (held-out tokens)")
    p.add_argument("--model", type=Path, default=REPO / "checkpoints" / "default")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    windows = held_out_windows(args.work, args.window)
    model = jmoe.load(args.model, progress=False)
    result = {"window": args.window, "dtype": model.config.dtype,
              "held_out": perplexity(model, windows, args.batch),
              "routing": routing_skew(model, windows, args.batch),
              "samples": [cli_sample(prompt, args.max_new_tokens) for prompt in PROMPTS]}
    (args.model / "evaluation.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
