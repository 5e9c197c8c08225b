"""Expert biases (GPT-OSS): b_gate_up [S, 2f] added to x W_gate_up and b_down [S, d] to h W_down, before the
router weight, as Hugging Face does. Most families have none (None), which costs nothing."""

import jax.numpy as jnp


def bias_rows(bias, index):
    """float32 bias[index] (leading axes), or 0.0 for experts without a bias."""
    return 0.0 if bias is None else bias[index].astype(jnp.float32)
