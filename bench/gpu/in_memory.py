"""A model whose checkpoint would not fit on the disk, built in memory for bench.gpu_decode_bound: random weights at a
published shape (issue #54 item 7: GPT-OSS-120B's, about 61 GB of MXFP4 experts; a lent H200 machine has 128 GiB of
RAM and 64 GiB of disk), each parameter drawn at random and placed as jmoe.load places a checkpoint's: experts past
the device budget in pinned host memory, through the same placement and engine.

Sane scales rather than a trained model's values: matrices N(0, 0.02) and norms 1, as jmoe.random_model initialises
them, biases and attention sinks 0, MXFP4 expert codes random bytes with every block's scale 2^-7 (e2m1 codes reach 6:
weights within +-0.047, about 0.02 RMS). Each parameter is drawn on the device (jax.random, one compiled program per
shape) and then moved where the placement puts it: NumPy took 2.8 s a GB on a 2-core guest, page faults mostly, which
would be minutes of a lent GPU's time for 61 GB, where a device draws at its memory's speed and a placement in pinned
host memory copies at the link's (about 1.3 s for 61 GB at 50 GB/s; unmeasured)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jmoe.model.layers import INIT_STD  # jmoe.random_model's scale

MXFP4_SCALE_BYTE = 127 - 7  # e8m0: 2^(byte - 127)


class InMemoryModel:
    """Hugging Face `config`'s parameters drawn at random and placed by jmoe.load's rules for `load_options` (cache,
    device_budget_gb, expert_dtype "mxfp4" or a float, ...), once; `model(miss_mode)` makes a jmoe Model over them
    with an engine of its own (the placement does not depend on the miss mode). No tokenizer."""

    def __init__(self, config: dict, seed: int = 0, **load_options):
        import jax.numpy as jnp
        from flax import nnx

        from jmoe.config import parse_config, with_expert_dtype
        from jmoe.kernels import FORMATS
        from jmoe.memory import sharding_for
        from jmoe.model.params import abstract_model, flat_params, nest_params
        from jmoe.offload.expert_parallel import device_placement
        from jmoe.offload.options import OffloadOptions

        self.options = OffloadOptions(**load_options)
        self.config = with_expert_dtype(parse_config(config), self.options.expert_dtype,
                                        self.options.expert_group_size)
        if self.config.expert_dtype in FORMATS and self.config.expert_dtype != "mxfp4":
            raise ValueError(f"InMemoryModel draws float or mxfp4 experts, found {self.config.expert_dtype!r}")
        graphdef, state = abstract_model(self.config, jnp.dtype(self.config.dtype))
        abstract = flat_params(nnx.to_pure_dict(state))
        self.placement = device_placement(self.config, abstract, self.options, 1)
        key = jax.random.key(seed)
        placed = {}
        for index, (path, leaf) in enumerate(abstract.items()):
            drawn = random_parameter(path, leaf.shape, jnp.dtype(leaf.dtype), jax.random.fold_in(key, index))
            # Waited for: the draws must not pile up on the device while their copies to the host are in flight.
            where = sharding_for(self.placement.memory_kind_of(path))
            placed[path] = jax.block_until_ready(jax.device_put(drawn, where))
            del drawn
        nnx.replace_by_pure_dict(state, nest_params(placed))
        self.module = nnx.merge(graphdef, state)

    def model(self, miss_mode: str | None = None, backend: str = "auto"):
        import dataclasses

        from jmoe.api import Model
        from jmoe.offload.engine import make_engine

        options = self.options if miss_mode is None else dataclasses.replace(self.options, miss_mode=miss_mode)
        return Model(self.module, self.config, make_engine(self.config, self.placement, options, backend))


def random_parameter(path: tuple, shape: tuple, dtype, key):
    """Parameter `path`'s values, drawn on the default device (module docstring)."""
    import jax.numpy as jnp

    name = str(path[-1])
    if name == "scale":  # a norm's
        return jnp.ones(shape, dtype)
    if name.endswith("_scale"):  # an mxfp4 expert weight's block scales
        return jnp.full(shape, MXFP4_SCALE_BYTE, dtype)
    if name.startswith("b_") or name in ("bias", "sinks"):
        return jnp.zeros(shape, dtype)
    return _drawn(shape, dtype, key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _drawn(shape: tuple, dtype, key):
    if dtype == np.uint8:  # packed codes
        return jax.random.bits(key, shape, dtype)
    return (jax.random.normal(key, shape, np.float32) * INIT_STD).astype(dtype)
