"""Tiny random-weight Hugging Face checkpoints of every supported family, written with save_pretrained.

They are the reference: transformers (PyTorch, CPU) loads the same files jmoe loads.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 96

# name -> (model_type, config overrides). Shapes vary: experts, top-k, GQA ratio, tied/untied,
# shared expert, dense layers, sliding window, per-head vs full q/k norm, qkv clipping; DeepSeek-V3's latent
# attention with and without q_lora, expert groups, YaRN, interleaved rotary; GLM-4.5's partial rotary.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 1.0}
FAMILY_CASES = {
    "mixtral_e4k2_gqa2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=48)),
    "mixtral_e8k3_mqa_tied_window": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=3,
                                                     num_attention_heads=4, num_key_value_heads=1,
                                                     intermediate_size=40, tie_word_embeddings=True,
                                                     sliding_window=6)),
    "qwen2_moe_shared_dense": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                                                 shared_expert_intermediate_size=40, intermediate_size=56,
                                                 mlp_only_layers=[1], num_attention_heads=4,
                                                 num_key_value_heads=2, num_hidden_layers=3)),
    "qwen2_moe_sparse_step_norm": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                     intermediate_size=32, decoder_sparse_step=2,
                                                     norm_topk_prob=True, num_attention_heads=2,
                                                     num_key_value_heads=2, num_hidden_layers=4)),
    "qwen3_moe_headdim_tied": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                                 intermediate_size=48, head_dim=16, norm_topk_prob=True,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 tie_word_embeddings=True)),
    "olmoe_e8k4_clip": ("olmoe", dict(num_experts=8, num_experts_per_tok=4, intermediate_size=24,
                                      num_attention_heads=4, num_key_value_heads=4, clip_qkv=4.0)),
    "deepseek_v3_qlora_groups": ("deepseek_v3", dict(
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=16,
        n_shared_experts=2, intermediate_size=40, first_k_dense_replace=1, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, attention_bias=True, routed_scaling_factor=2.5)),
    "deepseek_v3_yarn_plain_q": ("deepseek_v3", dict(
        n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=24,
        n_shared_experts=1, intermediate_size=32, first_k_dense_replace=0, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=False, norm_topk_prob=False, routed_scaling_factor=1.5, rope_parameters=YARN,
        tie_word_embeddings=True)),
    "glm4_moe_partial_qknorm": ("glm4_moe", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
        intermediate_size=40, first_k_dense_replace=1, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5)),
    # transformers' own YaRN default (factor 32), sliding windows shorter than the prompts, sinks, biases
    "gpt_oss_e4k2_window": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            sliding_window=4)),
    "gpt_oss_e8k3_mqa_tied_yarn": ("gpt_oss", dict(
        num_local_experts=8, num_experts_per_tok=3, intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=6, num_hidden_layers=3, tie_word_embeddings=True,
        swiglu_limit=3.0, rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                               truncate=False, original_max_position_embeddings=64,
                                               rope_theta=150000.0))),
}
# Routers whose selection bias transformers initialises to zero get random values, so the tests see it work;
# so do the expert biases and attention biases it initialises to zero.
SCORE_BIAS_STD = 0.2
BIAS_STD = 0.1


class BuiltOnFirstUse(dict):
    """A dict whose value for a key is built by `build(key)` the first time it is read: a fixture over every family
    case costs a test module (or an xdist worker, or the quick tier) only the cases its tests read."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def __missing__(self, key):
        self[key] = self.build(key)
        return self[key]


def hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, max_position_embeddings=256,
                initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                rms_norm_eps=1e-6)
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def write_checkpoint(directory: Path, model_type: str, seed: int = 0, max_shard_size=None, **overrides):
    """Build a random model with transformers and save it (safetensors). Returns the torch model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **overrides)).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, SCORE_BIAS_STD)
        for name, param in model.named_parameters():
            if (name.endswith("_bias") or name.endswith(".bias")) and not param.any():
                param.normal_(0.0, BIAS_STD)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def write_word_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer.json whose words are w0 .. w{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
