"""Reference MoE FFN: plain gather + einsum in float32 at HIGHEST precision (the test oracle,
and the path the model uses to match Hugging Face fp32 logits)."""

import jax
import jax.numpy as jnp

from jmoe.kernels.activations import get_activation
from jmoe.kernels.bias import bias_rows
from jmoe.kernels.quantized import rows_of

_HIGHEST = jax.lax.Precision.HIGHEST


def moe_ffn_reference(x, slot_ids, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
                      activation="swiglu"):
    act = get_activation(activation)
    f = w_down.shape[1]
    valid = slot_ids >= 0
    # -1 must never select real weights: clamp to slot 0 for the gather, then drop the
    # contribution with a select (not a multiply, so NaN/Inf in slot 0 cannot leak in).
    safe_ids = jnp.where(valid, slot_ids, 0)
    # Quantized weights: dequantize (to x's dtype) the gathered slots, then the same math.
    w_gu = rows_of(w_gate_up, safe_ids, x.dtype)  # [T, k, d, 2f]
    w_d = rows_of(w_down, safe_ids, x.dtype)  # [T, k, f, d]
    gate_up = jnp.einsum(
        "td,tkdn->tkn", x, w_gu, precision=_HIGHEST, preferred_element_type=jnp.float32
    ) + bias_rows(b_gate_up, safe_ids)
    h = act(gate_up[..., :f], gate_up[..., f:]).astype(x.dtype)
    out = jnp.einsum(
        "tkf,tkfd->tkd", h, w_d, precision=_HIGHEST, preferred_element_type=jnp.float32
    ) + bias_rows(b_down, safe_ids)
    # HF order: router weight applied after the down projection, then summed over k.
    out = out * weights.astype(jnp.float32)[..., None]
    out = jnp.where(valid[..., None], out, 0.0)
    return out.sum(axis=1)
