"""Grouped-GEMM MoE FFN kernels behind one dispatch (imported as jmoe.kernels)."""

from jmoe.kernels.activations import ACTIVATIONS
from jmoe.kernels.dispatch import BACKENDS, ExpertKernel, ExpertWeights, moe_ffn
from jmoe.kernels.float_bits import FloatBits
from jmoe.kernels.per_expert import float_bits_views, per_expert_views
from jmoe.kernels.quantized import FORMATS, QuantizedTensor, quantize
from jmoe.kernels.reference import moe_ffn_reference

__all__ = ["ACTIVATIONS", "BACKENDS", "FORMATS", "ExpertKernel", "ExpertWeights", "FloatBits", "QuantizedTensor",
           "float_bits_views", "moe_ffn", "moe_ffn_reference", "per_expert_views", "quantize"]
