"""Rotary position embedding settings from config.json: transformers>=5 `rope_parameters` or the older
`rope_theta` / `rope_scaling`, for the rope types jmoe computes (jmoe.model.rope)."""

from __future__ import annotations

import dataclasses
import math

from jmoe.config_values import positive_float, size
from jmoe.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN rotary scaling, as config.json states it (transformers' `_compute_yarn_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float  # multiplies cos and sin
    truncate: bool  # round the correction range outwards to whole dimensions


def _rope_type(params: dict, scaling: dict, source: str) -> str:
    for where, key, value in (("rope_parameters", "rope_type", params.get("rope_type")),
                              ("rope_scaling", "rope_type", scaling.get("rope_type")),
                              ("rope_scaling", "type", scaling.get("type"))):
        if value is not None:
            if value not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"{source}: unsupported rope scaling type {value!r} in {where}.{key}; supported: "
                                  f"{', '.join(SUPPORTED_ROPE_TYPES)}; use a model whose config names one of these")
            return value
    return "default"


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_settings(hf: dict, source: str) -> tuple[float, float, Yarn | None, float]:
    """(theta, linear factor, YaRN parameters, softmax-scale multiplier for MLA) from transformers>=5
    `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be an object, found {value!r}; fix config.json")
    theta = positive_float({"rope_theta": params.get("rope_theta", hf.get("rope_theta"))}, "rope_theta", source,
                            10000.0)
    rope_type = _rope_type(params, scaling, source)
    merged = {**scaling, **params}
    named = {f"rope_parameters.{k}": v for k, v in merged.items()}

    def number(key: str, default, *, zero_ok: bool = False) -> float:
        value = merged.get(key)
        if zero_ok and value == 0 and not isinstance(value, bool):
            return 0.0
        return positive_float(named, f"rope_parameters.{key}", source, default)

    if rope_type == "default":
        return theta, 1.0, None, 1.0
    if rope_type == "linear":
        factor = number("factor", 1.0)
        mscale_all_dim = number("mscale_all_dim", 0.0, zero_ok=True) if merged.get("mscale_all_dim") else 0.0
        return theta, factor, None, _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    original = hf.get("original_max_position_embeddings", merged.get("original_max_position_embeddings"))
    original = size({"original_max_position_embeddings": original}, "original_max_position_embeddings", source,
                     size(hf, "max_position_embeddings", source), limit_key="max_position_embeddings")
    if merged.get("factor") is None:  # DeepSeek-style: the ratio of the two context lengths
        factor = size(hf, "max_position_embeddings", source) / original
    else:
        factor = number("factor", None)
    mscale = number("mscale", 0.0, zero_ok=True) if merged.get("mscale") is not None else 0.0
    mscale_all_dim = number("mscale_all_dim", 0.0, zero_ok=True) if merged.get("mscale_all_dim") is not None else 0.0
    if merged.get("attention_factor") is not None:
        attention_factor = number("attention_factor", None)
    elif mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{source}: rope_parameters.truncate must be true or false, found {truncate!r}; fix "
                          f"config.json")
    yarn = Yarn(factor=factor, original_max_position_embeddings=original,
                beta_fast=number("beta_fast", 32.0) if merged.get("beta_fast") else 32.0,
                beta_slow=number("beta_slow", 1.0) if merged.get("beta_slow") else 1.0,
                attention_factor=attention_factor, truncate=truncate)
    return theta, 1.0, yarn, _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
