"""Config sizes against the checkpoint's tensors, checked before anything is built per layer or per expert.

A config.json can describe a model far larger than its weights (hostile or mismatched: `num_local_experts:
1000000` next to 8 experts' tensors). Building the name table or the abstract model of that config costs
minutes and gigabytes before the per-tensor shape check would fail, so this compares a cheap lower bound of
the parameters the config implies with the values the headers hold, first.
"""

from __future__ import annotations

from pathlib import Path

from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError

# Stored values may be packed below one per parameter (4-bit formats hold two per byte, plus scales): the
# bound allows this much before calling the config and the weights a mismatch.
PACKING_SLACK = 8


def parameter_lower_bound(cfg: ModelConfig) -> int:
    """Parameters every supported family has at least: embeddings, attention projections, routed experts."""
    embeddings = cfg.vocab_size * cfg.hidden_size
    if cfg.mla is None:
        attention = cfg.num_layers * cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
    else:  # the latent projections and the output projection, whichever query projection there is
        m = cfg.mla
        attention = cfg.num_layers * (cfg.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim)
                                      + m.kv_lora_rank * cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
                                      + cfg.num_heads * m.v_head_dim * cfg.hidden_size)
    experts = cfg.num_moe_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_intermediate_size
    return embeddings + attention + experts


def check_sizes_against_tensors(source: Path, cfg: ModelConfig, stored_values: int) -> None:
    """Refuse a config that needs more parameters than the checkpoint's tensors can hold."""
    needed = parameter_lower_bound(cfg)
    if needed > PACKING_SLACK * stored_values:
        raise CheckpointError(
            f"{source}: config.json describes at least {needed:,} parameters ({cfg.num_layers} layers, "
            f"{cfg.num_experts} experts of width {cfg.expert_intermediate_size}, hidden size {cfg.hidden_size}, "
            f"vocabulary {cfg.vocab_size}), but the checkpoint's tensors hold {stored_values:,} values: the config "
            f"and the weights do not belong together; use the config.json the weights were saved with")
