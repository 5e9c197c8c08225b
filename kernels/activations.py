"""Expert activations: a small registry so later families (e.g. GPT-OSS clamped SwiGLU with
biases) plug in without touching the kernels. Each entry maps (gate, up) in float32 to h."""

import jax


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    # Mixtral / Qwen-MoE / OLMoE / DeepSeek: silu(x Wg) * (x Wu).
    return jax.nn.silu(gate) * up


ACTIVATIONS = {"swiglu": swiglu}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"moe_ffn: unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}"
        ) from None
