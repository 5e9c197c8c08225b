"""Checks on config.json values: each says which key, what was found and what to write.

`SIZE_LIMITS` bounds every size before anything is built from it (jmoe.config parses with these).
"""

from __future__ import annotations

import math
from typing import Any

from jmoe.errors import ConfigError


def required(hf: dict, key: str, source: str, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise ConfigError(f"{source}: missing required key {key!r} for model_type {hf.get('model_type')!r}; "
                          f"add it to config.json")
    return default


# Sane upper bounds on config sizes, checked before anything is built from them: far above any published
# model, far below what would exhaust memory while building per-layer or per-expert tables. A config that
# passes is then checked against the checkpoint's tensors (jmoe.checkpoint.bounds) before any allocation.
SIZE_LIMITS = {
    "hidden_size": 1 << 17, "num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
    "head_dim": 4096, "experts": 1 << 16, "num_experts_per_tok": 1 << 16, "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 27, "expert_width": 1 << 20, "intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20, "lora_rank": 1 << 17, "n_group": 1 << 16,
    "n_shared_experts": 1 << 10, "fp8_block": 1 << 16,
}


def size(hf: dict, key: str, source: str, default: Any = ..., *, low: int = 1, limit_key: str | None = None) -> int:
    """A whole-number config value in [low, SIZE_LIMITS[limit_key or key]]: booleans, fractions, strings and
    out-of-range values are errors that say what was found and what to write."""
    value = required(hf, key, source, default)
    high = SIZE_LIMITS[limit_key or key]
    whole = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and value.is_integer():
        value, whole = int(value), True
    if not whole or not low <= value <= high:
        raise ConfigError(f"{source}: {key} must be a whole number in [{low}, {high}], found {value!r}; fix "
                          f"config.json")
    return value


def positive_float(hf: dict, key: str, source: str, default: float) -> float:
    value = required(hf, key, source, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a finite number > 0, found {value!r}; fix config.json")
    return float(value)


def boolean(hf: dict, key: str, source: str) -> bool:
    value = hf.get(key)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, found {value!r}; fix config.json")
    return value
