"""A jitted training step for jmoe's own `MoETransformer`.

jmoe's forward accepts an `expert_compute` callable that replaces the resident expert computation.
Training passes one that does capacity-based dispatch (GShard/Switch style): each expert processes at
most `capacity` (token, choice) pairs per step in one batched matmul, so the cost is ~capacity_factor
times the top-k cost instead of running every expert on every token. Pairs over capacity are dropped
(they add nothing; the residual carries the token); the dropped fraction is logged. Inference (jmoe,
transformers) never drops.

The same callable receives the router input h, so it also computes the Switch load-balancing loss
E * sum_e(load_e * mean_prob_e) (1.0 when perfectly balanced) from the layer's own router.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.model import empty_kv_cache


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_moe(x, ids, weights, w_gate_up, w_down, capacity: int):
    """x [N, d], ids [N, k], weights [N, k], w_gate_up [E, d, 2f], w_down [E, f, d] -> (y [N, d], dropped)."""
    n, k = ids.shape
    e, d = w_gate_up.shape[0], x.shape[1]
    # Choice-major order: every token's first choice gets a slot before any second choice does.
    flat_ids = ids.T.reshape(-1)
    flat_w = weights.T.reshape(-1)
    token = jnp.arange(n * k) % n
    onehot = jax.nn.one_hot(flat_ids, e, dtype=jnp.int32)
    pos = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
    keep = pos < capacity
    slot = jnp.where(keep, flat_ids * capacity + pos, e * capacity)  # row e*capacity: discarded
    buf = jnp.zeros((e * capacity + 1, d), x.dtype).at[slot].set(x[token])
    xe = buf[:-1].reshape(e, capacity, d)
    gate, up = jnp.split(jnp.einsum("ecd,edf->ecf", xe, w_gate_up), 2, axis=-1)
    ye = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down).reshape(e * capacity, d)
    ye = jnp.concatenate([ye, jnp.zeros((1, d), ye.dtype)])
    pairs = ye[slot] * (flat_w * keep)[:, None]
    return pairs.reshape(k, n, d).sum(0), 1.0 - jnp.mean(keep)


def load_balance_loss(router_logits, ids, num_experts: int):
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    load = jnp.mean(jax.nn.one_hot(ids.reshape(-1), num_experts, dtype=jnp.float32), axis=0)
    return num_experts * jnp.sum(load * jnp.mean(probs, axis=0))


class Metrics(NamedTuple):
    loss: jax.Array  # cross-entropy, nats per token
    balance: jax.Array  # mean load-balancing loss over MoE layers
    dropped: jax.Array  # mean fraction of (token, choice) pairs over capacity


def make_loss_fn(graphdef, cfg: ModelConfig, batch: int, seq_len: int, capacity_factor: float,
                 balance_coef: float):
    capacity = expert_capacity(batch * seq_len, cfg.num_experts_per_tok, cfg.num_experts, capacity_factor)

    def loss_fn(params, tokens):
        model = nnx.merge(graphdef, params)
        blocks = model.moe_blocks()
        aux = []

        def expert_compute(moe_pos, h, ids, weights):
            block = blocks[moe_pos]
            y, dropped = capacity_moe(h, ids, weights, block.experts.w_gate_up[...], block.experts.w_down[...],
                                      capacity)
            aux.append((load_balance_loss(block.router(h), ids, cfg.num_experts), dropped))
            return y

        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        out = model(inputs, empty_kv_cache(cfg, batch, seq_len, jnp.float32), 0, jnp.zeros(batch, jnp.int32),
                    expert_compute=expert_compute)
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, targets).mean()
        balance = jnp.mean(jnp.stack([a[0] for a in aux]))
        dropped = jnp.mean(jnp.stack([a[1] for a in aux]))
        return ce + balance_coef * balance, Metrics(ce, balance, dropped)

    return loss_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, loss_fn):
    @jax.jit
    def train_step(params, opt_state, tokens):
        grads, metrics = jax.grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return train_step


def make_optimizer(peak_lr: float, warmup_steps: int, total_steps: int, weight_decay: float,
                   clip_norm: float) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup_steps, total_steps, end_value=peak_lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))
