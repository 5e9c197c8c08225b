"""Expert activations: a small registry of (gate, up) in float32 -> h, named by a string that the kernels
take as a static argument. A parametrised activation writes its parameters into the name
("clamped_swiglu:7.0:1.702"), so one name says everything a compiled program depends on."""

import functools

import jax
import jax.numpy as jnp


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    # Mixtral / Qwen-MoE / OLMoE / DeepSeek: silu(x Wg) * (x Wu).
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, limit: float, alpha: float) -> jax.Array:
    # GPT-OSS: gate clipped from above, up clipped both ways, (up + 1) * gate * sigmoid(alpha * gate).
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


ACTIVATIONS = {"swiglu": swiglu, "clamped_swiglu": clamped_swiglu}
_PARAMETERS = {"clamped_swiglu": ("limit", "alpha")}


def activation_name(base: str, **parameters: float) -> str:
    """The registry name of `base` with its parameters, e.g. clamped_swiglu:7.0:1.702."""
    return ":".join([base, *(repr(float(parameters[p])) for p in _PARAMETERS.get(base, ()))])


@functools.cache
def get_activation(name: str):
    base, *values = name.split(":")
    expected = _PARAMETERS.get(base, ())
    if base not in ACTIVATIONS or len(values) != len(expected):
        spelled = [":".join([b, *(f"<{p}>" for p in _PARAMETERS.get(b, ()))]) for b in sorted(ACTIVATIONS)]
        raise ValueError(f"moe_ffn: unknown activation {name!r}; expected one of {spelled}")
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        raise ValueError(f"moe_ffn: activation {name!r} has parameters that are not numbers") from None
    return functools.partial(ACTIVATIONS[base], **dict(zip(expected, numbers))) if expected else ACTIVATIONS[base]
