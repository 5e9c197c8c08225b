"""Grouped-GEMM MoE FFN kernels behind one dispatch (imported as jmoe.kernels)."""
