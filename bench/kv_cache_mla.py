"""KV-cache bytes per token: multi-head latent attention (what jmoe stores: the compressed latent and the roped
shared key) against the same model caching full keys and values, at the published DeepSeek-V3 and Kimi K2
sizes, and the cache jmoe actually allocates for them (shape structs, nothing is allocated).

  python -m bench.kv_cache_mla [--smoke]   (--smoke: the same, writing no result file)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.helpers.common import add_smoke_argument, smoke_run, write_result
from jmoe.config import parse_config
from jmoe.model.transformer import empty_kv_cache, kv_bytes_per_token

# Published config.json values that size the attention (the rest only needs to parse).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840, norm_topk_prob=True,
    routed_scaling_factor=2.5, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0))
# Kimi K2 has DeepSeek-V3's architecture with 64 heads and 384 experts; only the head count changes the cache.
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
           "n_routed_experts": 384, "n_group": 1, "topk_group": 1}
DTYPE = jnp.bfloat16


def row(name: str, hf: dict, context: int = 4096) -> str:
    cfg = parse_config(hf, name)
    m = cfg.mla
    mla = kv_bytes_per_token(cfg, DTYPE)
    allocated = jax.eval_shape(lambda: empty_kv_cache(cfg, 1, context, DTYPE))
    allocated_bytes = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(allocated))
    assert allocated_bytes == mla * context, (allocated_bytes, mla * context)
    # The same model caching full keys (nope + rope dims) and values for every head.
    full = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    return (f"| {name} | {cfg.num_layers} | {cfg.num_heads} | {m.kv_lora_rank} + {m.qk_rope_head_dim} | {mla:,} | "
            f"{full:,} | {full / mla:.1f}x | {mla * 131072 / 2**30:.2f} GiB | {full * 131072 / 2**30:.2f} GiB |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    with smoke_run(args):
        report()


def report() -> None:
    rows = [row("DeepSeek-V3", DEEPSEEK_V3), row("Kimi K2", KIMI_K2)]
    body = ("bfloat16 cache, per token of one sequence over all layers. MLA: what `jmoe.model.mla` stores "
            "(latent after kv_a_layernorm + the roped shared key; `kv_bytes_per_token`), checked against the shapes "
            "`empty_kv_cache` allocates for a 4096-token sequence. Full K/V: the same model caching every head's "
            "key (nope + rope dims) and value, as an attention without the absorbed form would.\n\n"
            "| model | layers | heads | cached per layer | MLA bytes/token | full K/V bytes/token | ratio | MLA at 128k tokens | "
            "full K/V at 128k |\n|---|---:|---:|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    path = write_result("kv_cache_mla.md", "KV-cache bytes per token: MLA against full K/V", body)
    print(path.read_text())


if __name__ == "__main__":
    main()
