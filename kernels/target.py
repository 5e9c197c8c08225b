"""The GPU a program is being compiled for when this machine has none (ahead-of-time compilation for a
target such as an H100 through a compile-only CUDA topology).

Pallas kernels choose their lowering from the platform the program is lowered for (`platform_dependent`
here, which is `lax.platform_dependent` wherever a GPU can be the target). Kernels that must know the
target before lowering do: jax-triton asks the device for its compute capability, which a compile-only
target cannot answer, so the caller that compiles for a target says which one it is.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_COMPUTE_CAPABILITY: contextvars.ContextVar[int | None] = contextvars.ContextVar("jmoe_gpu_compute_capability",
                                                                                 default=None)


@contextlib.contextmanager
def compiling_for_gpu(compute_capability: int):
    """Within this block, programs are traced for a GPU of this compute capability (e.g. 90 for an H100)."""
    # A trace holds only the branches of `platform_dependent` for the platform it was made for, and JAX would reuse it
    # for the same function and shapes (its trace cache does not see this setting): trace afresh on entry and on exit.
    jax.clear_caches()
    token = _COMPUTE_CAPABILITY.set(int(compute_capability))
    try:
        yield
    finally:
        _COMPUTE_CAPABILITY.reset(token)
        jax.clear_caches()


def target_compute_capability() -> int | None:
    """The compute capability given to `compiling_for_gpu`, or None (then a GPU, if any, is asked)."""
    return _COMPUTE_CAPABILITY.get()


def gpu_available() -> bool:
    """Whether programs traced now will run on, or be compiled for, a GPU."""
    return target_compute_capability() is not None or jax.default_backend() == "gpu"


def platform_dependent(*args, cpu=None, cuda=None, default):
    """`jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default)` (None: no such branch), tracing only
    what can run. lax.platform_dependent traces every branch; where JAX runs on the CPU, a program can only be
    lowered for the CPU (its branch, `cpu`, else `default`, is traced) or, within `compiling_for_gpu`, for the
    compile-only CUDA target (`cuda`, else `default`). The GPU grouped GEMM's branch was half of tracing a CPU decode
    program (0.68 of 1.34 s, the default model); the interpreted one's, a third of tracing an H100 plan's programs."""
    if jax.default_backend() == "cpu":
        if target_compute_capability() is None:
            return (default if cpu is None else cpu)(*args)
        return (default if cuda is None else cuda)(*args)
    branches = {name: branch for name, branch in (("cpu", cpu), ("cuda", cuda)) if branch is not None}
    return jax.lax.platform_dependent(*args, **branches, default=default)
