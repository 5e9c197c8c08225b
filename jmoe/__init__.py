"""jmoe: run MoE language models in JAX on an accelerator too small to hold them."""
