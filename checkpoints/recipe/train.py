"""Build the corpus, train the tokenizer, train the model, export checkpoints/default.

    python -m checkpoints.recipe.train --work /tmp/jmoe-default            # the shipped model
    python -m checkpoints.recipe.train --work /tmp/jmoe-default --bench 5  # measure step time only

Everything bulky (tokenizer, token streams, step log, parameter snapshots) goes to --work; only the
final export goes to --out. Parameter snapshots are written every --save-every steps so a cut-off run
can still be exported with --export-from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.recipe.corpus import load_corpus
from checkpoints.recipe.export import export, qwen3_moe_config
from checkpoints.recipe.moe_train import make_loss_fn, make_optimizer, make_train_step
from checkpoints.recipe.tokenizer import EOS_TOKEN, token_stream, train_tokenizer
from jmoe.config import parse_config
from jmoe.model.params import flat_params, nest_params
from jmoe.model import MoETransformer

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="scratch directory (not committed)")
    p.add_argument("--out", type=Path, default=REPO / "checkpoints" / "default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=48)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=192)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--warmup", type=int, default=45)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--capacity-factor", type=float, default=2.0)
    p.add_argument("--balance-coef", type=float, default=0.05)
    p.add_argument("--storage-dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--bench", type=int, default=0, help="only time this many steps after compiling, then exit")
    p.add_argument("--export-from", type=Path, default=None, help="export this parameter snapshot and exit")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this parameter snapshot (a second stage with a fresh schedule); the previous "
                        "stage's training.json in --out is kept inside the new one")
    return p.parse_args(argv)


def prepare_data(work: Path, vocab_size: int) -> dict:
    """Corpus, tokenizer and token streams in `work` (reused when already there)."""
    summary_path = work / "data.json"
    if summary_path.is_file():
        return json.loads(summary_path.read_text())
    t0 = time.time()
    corpus = load_corpus()
    tok = train_tokenizer(corpus.train.texts, vocab_size)
    tok.save(str(work / "tokenizer.json"))
    train, val = token_stream(tok, corpus.train.texts), token_stream(tok, corpus.validation.texts)
    np.save(work / "train_tokens.npy", train)
    np.save(work / "validation_tokens.npy", val)
    summary = {**corpus.summary(), "validation_file_names": corpus.validation.names,
               "train_tokens": int(train.size), "validation_tokens": int(val.size),
               "tokenizer": {"type": "byte-level BPE (HF tokenizers), trained on the training split",
                             "vocab_size": tok.get_vocab_size(), "eos_token": EOS_TOKEN,
                             "eos_token_id": tok.token_to_id(EOS_TOKEN)},
               "prepare_seconds": round(time.time() - t0, 1)}
    summary_path.write_text(json.dumps(summary, indent=1))
    return summary


def hf_config_for(args, vocab_size: int, eos_id: int) -> dict:
    return qwen3_moe_config(vocab_size=vocab_size, hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                            num_experts=args.experts, top_k=args.top_k, expert_width=args.expert_width,
                            max_positions=args.max_positions, rope_theta=args.rope_theta, eos_token_id=eos_id,
                            dtype=args.storage_dtype)


def save_snapshot(params: nnx.State, path: Path) -> None:
    flat = flat_params(nnx.to_pure_dict(params))
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **{"/".join(map(str, k)): np.asarray(v) for k, v in flat.items()})
    os.replace(tmp, path)


def load_snapshot(params: nnx.State, path: Path) -> nnx.State:
    with np.load(path) as data:
        flat = {k: jnp.asarray(data["/".join(map(str, k))]) for k in flat_params(nnx.to_pure_dict(params))}
    nnx.replace_by_pure_dict(params, nest_params(flat))
    return params


def sample_batch(rng: np.random.Generator, stream: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch)
    return np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.work, args.vocab_size)
    train_stream = np.load(args.work / "train_tokens.npy")
    val_stream = np.load(args.work / "validation_tokens.npy")
    hf_config = hf_config_for(args, data["tokenizer"]["vocab_size"], data["tokenizer"]["eos_token_id"])
    cfg = parse_config(hf_config).replace(dtype="float32")  # train in fp32; stored as --storage-dtype
    graphdef, params = nnx.split(MoETransformer(cfg, rngs=nnx.Rngs(args.seed)))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"parameters: {n_params:,}; train tokens {data['train_tokens']:,}; "
          f"validation tokens {data['validation_tokens']:,}", flush=True)

    if args.export_from is not None:
        export(load_snapshot(params, args.export_from), hf_config, args.work / "tokenizer.json", args.out)
        print(f"exported {args.export_from} to {args.out}")
        return

    if args.init_from is not None:
        params = load_snapshot(params, args.init_from)
    loss_fn = make_loss_fn(graphdef, cfg, args.batch, args.seq_len, args.capacity_factor, args.balance_coef)
    tx = make_optimizer(args.lr, args.warmup, args.steps, args.weight_decay, args.clip_norm)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx, loss_fn)
    eval_loss = jax.jit(lambda p, t: loss_fn(p, t)[1])
    rng = np.random.default_rng(args.seed)
    val_batches = [sample_batch(np.random.default_rng(args.seed + 1), val_stream, args.batch, args.seq_len)
                   for _ in range(4)]

    t0 = time.time()
    params, opt_state, m = train_step(params, opt_state, sample_batch(rng, train_stream, args.batch, args.seq_len))
    jax.block_until_ready(m)
    compile_seconds = time.time() - t0
    print(f"step 1 (compile + run): {compile_seconds:.1f}s, loss {float(m.loss):.3f}", flush=True)
    tokens_per_step = args.batch * args.seq_len
    if args.bench:
        t0 = time.time()
        for _ in range(args.bench):
            params, opt_state, m = train_step(params, opt_state,
                                              sample_batch(rng, train_stream, args.batch, args.seq_len))
        jax.block_until_ready(m)
        dt = (time.time() - t0) / args.bench
        print(f"{dt:.3f} s/step, {tokens_per_step / dt:.0f} tokens/s, loss {float(m.loss):.3f}, "
              f"dropped {float(m.dropped):.3f}")
        return

    log = open(args.work / "train_log.jsonl", "w")
    curve = []
    t_start = time.time()
    for step in range(2, args.steps + 1):
        params, opt_state, m = train_step(params, opt_state, sample_batch(rng, train_stream, args.batch, args.seq_len))
        if step % args.log_every == 0 or step == args.steps:
            m = jax.device_get(m)  # waits for the step, so the time below is not ahead of the work
            rec = {"step": step, "seconds": round(time.time() - t_start, 1), "loss": round(float(m.loss), 4),
                   "balance": round(float(m.balance), 4), "dropped": round(float(m.dropped), 4)}
            if step % args.eval_every == 0 or step == args.steps:
                rec["val_loss"] = round(float(np.mean([float(eval_loss(params, b).loss) for b in val_batches])), 4)
                curve.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
        if step % args.save_every == 0:
            save_snapshot(params, args.work / "params.npz")
    train_seconds = time.time() - t_start + compile_seconds
    save_snapshot(params, args.work / "params.npz")

    previous = args.out / "training.json"
    previous_stage = json.loads(previous.read_text()) if args.init_from and previous.is_file() else None
    export(params, hf_config, args.work / "tokenizer.json", args.out)
    record = {
        "command": " ".join(["python -m checkpoints.recipe.train", *sys.argv[1:]]),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k not in ("work", "out", "bench", "export_from")},
        "optimizer": "clip_by_global_norm -> adamw(b1=0.9, b2=0.95), linear warmup then cosine to lr/10",
        "parameters": n_params,
        "tokens_seen": args.steps * tokens_per_step,
        "data": {k: v for k, v in data.items() if k != "validation_file_names"},
        "validation_files": data["validation_file_names"],
        "training_seconds": round(train_seconds, 1),
        "compile_seconds": round(compile_seconds, 1),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "jax": jax.__version__, "jax_backend": jax.default_backend()},
        "curve": curve,
    }
    if previous_stage is not None:
        record["previous_stage"] = previous_stage
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"done in {train_seconds / 60:.1f} min; exported to {args.out}")


if __name__ == "__main__":
    main()
