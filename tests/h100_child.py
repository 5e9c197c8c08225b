"""Compiling small functions for an H100 in a child process whose JAX starts on the CPU platform (a compile-only CUDA
topology cannot share a process with tests that already chose their platform): `run_in_h100_child(body)` runs
`body` after PREAMBLE, which defines `mesh`, `shaped(array)` (an abstract array on the device) and `compiled(fn,
*args)` (the optimized HLO text of fn traced for the H100), and returns what `body` printed last, as JSON."""

import json
import subprocess
import sys

PREAMBLE = """
import json, sys, functools, jax
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from jmoe.kernels.target import compiling_for_gpu
from jmoe.plan.targets import compute_capability, load_target
target = load_target("h100")
mesh = topologies.make_mesh(topologies.get_topology_desc(platform="cuda", target_config=target.config_text,
                                                         topology="1x1x1"), (1,), ("x",))
on_gpu = NamedSharding(mesh, PartitionSpec())
def shaped(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_gpu)
def compiled(fn, *args, for_gpu=True):
    with jax.set_mesh(mesh):
        if not for_gpu:  # XLA's own program: traced with no GPU target, so no platform choice takes a kernel
            return jax.jit(fn).trace(*args).lower().compile().as_text()
        with compiling_for_gpu(compute_capability(target.config_text)):
            return jax.jit(fn).trace(*args).lower().compile().as_text()
"""


def run_in_h100_child(body: str, *args: str):
    """The JSON `body` printed last, run after PREAMBLE with sys.argv[1:] = args (an assertion error naming the
    child's stderr if it failed)."""
    result = subprocess.run([sys.executable, "-c", PREAMBLE + body, *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
