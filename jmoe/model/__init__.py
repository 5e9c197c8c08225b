"""The Flax NNX MoE transformer: shared layers, attention, the MoE block, the decoder stack."""

from jmoe.model.moe import MoEBlock, MoELayerView, router_probabilities
from jmoe.model.transformer import (BeforeLayer, ExpertCompute, ForwardOut, MoETransformer, empty_kv_cache,
                                   kv_bytes_per_token)

__all__ = ["MoEBlock", "MoELayerView", "router_probabilities", "MoETransformer", "ForwardOut", "ExpertCompute",
           "BeforeLayer", "empty_kv_cache", "kv_bytes_per_token"]
