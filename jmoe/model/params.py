"""Parameter paths: the abstract (shape-only) model, flat {path: leaf} <-> nested dict conversions, and the parameters
as the compiled steps take them (`StepParams`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.model.transformer import MoETransformer

ParamPath = tuple  # e.g. ("layers", 3, "mlp", "experts", "w_down")


def param_key(path: ParamPath) -> str:
    """Dotted name of a parameter path, as used in placement patterns and reports."""
    return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and a state of shape/dtype structs: nothing is allocated. The state is the caller's own
    (a copy of the traced one: its leaves are immutable structs)."""
    dtype = None if dtype is None else jnp.dtype(dtype)
    trace = _traced_abstract_model if _hashable(cfg) else _traced_abstract_model.__wrapped__
    graphdef, state = trace(cfg, dtype)
    return graphdef, jax.tree.map(lambda leaf: leaf, state)


def abstract_params(cfg: ModelConfig, dtype) -> dict[ParamPath, object]:
    """{path: shape/dtype struct} of every parameter."""
    return flat_params(nnx.to_pure_dict(abstract_model(cfg, dtype)[1]))


def _hashable(cfg: ModelConfig) -> bool:
    try:  # a config read from a file may hold a list where a number is usual (pad_token_id: []); it is still valid
        hash(cfg)
    except TypeError:
        return False
    return True


@functools.lru_cache(maxsize=16)
def _traced_abstract_model(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    # Tracing the initialisation costs ~20 ms a layer; one load asks for the abstract model four or five times
    # (headers, placement, loading), a plan and a conversion again.
    # The key is made inside the trace: a concrete one would start JAX's backend, before jax.distributed.initialize.
    return nnx.split(nnx.eval_shape(lambda: MoETransformer(cfg, rngs=_SameKey(jax.random.key(0)), dtype=dtype)))


class _SameKey:
    """Stands in for nnx.Rngs where only shapes matter: every draw gets one key. nnx.Rngs counts its draws in a
    Variable, and every count set inside a trace asks the tracer for its sharding, whose error message walks the
    whole trace so far: quadratic in depth, 2.1 s of a 32-layer model's 2.4 s."""

    def __init__(self, key: jax.Array):
        self._key = key

    def params(self) -> jax.Array:
        return self._key


def flat_params(pure: dict, prefix: tuple = ()) -> dict[ParamPath, object]:
    """Nested pure dict -> {path tuple: leaf}."""
    flat = {}
    for key, value in pure.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, prefix + (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def nest_params(flat: dict[ParamPath, object]) -> dict:
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested


@jax.tree_util.register_pytree_node_class
class StepParams:
    """A model's parameters as its compiled steps take them: the NNX state's leaves in one list, with its treedef. A
    compiled program flattens its arguments at every call, and an NNX state costs a Python call a variable (about a
    microsecond each: 7% of the shipped model's decode token on a CPU, 0.6 ms a step of 36 layers) where a list is
    flattened in C++. `state` is the NNX state again, made once per object (a Model keeps one while its parameters
    stay the same object; in a trace it is made of the tracers)."""

    def __init__(self, leaves: list, treedef):
        self.leaves, self.treedef = leaves, treedef

    @classmethod
    def of(cls, state) -> "StepParams":
        params = cls(*jax.tree.flatten(state))
        params.state = state  # the state itself, not a copy: whoever keeps it finds it again by identity
        return params

    @functools.cached_property
    def state(self):
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves) -> "StepParams":
        return cls(list(leaves), treedef)
