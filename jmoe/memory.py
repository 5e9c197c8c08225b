"""Memory kinds: where a parameter lives. The one place that spells them.

`DEVICE` is accelerator memory; `PINNED_HOST` is page-locked host memory the accelerator can copy from
asynchronously (where offloaded experts live). Inside a jitted program the same places are addressed as
`jax.memory.Space.Device` / `jax.memory.Space.Host`.
"""

from __future__ import annotations

import functools
import inspect

import jax
from jax.experimental import compute_on as compute_on_module

DEVICE = "device"
PINNED_HOST = "pinned_host"
MEMORY_KINDS = (DEVICE, PINNED_HOST)


def sharding_for(memory_kind: str) -> jax.sharding.Sharding:
    """The single-device sharding that puts an array in `memory_kind` on this process's first device (in a
    jax.distributed run, jax.devices() starts with another process's devices)."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind=memory_kind)


def to_device(x):
    """Inside a jitted program: a copy of `x` in device memory (a no-op when it is there already)."""
    return jax.device_put(x, jax.memory.Space.Device)


def to_host(x):
    """Inside a jitted program: a copy of `x` in host memory (for computations run on the host)."""
    return jax.device_put(x, jax.memory.Space.Host)


# jax 0.10's compute_on is a context manager (around a jitted call: XLA:GPU then offloads the computation to the
# host); jax 0.11 made it a function transform and dropped the context manager (importing a module that used the
# old form failed on the lent H100's jax 0.11 image).
_COMPUTE_ON_IS_A_TRANSFORM = "out_memory_spaces" in inspect.signature(compute_on_module.compute_on).parameters


def computed_on_host(fn):
    """`fn` as a function that, called inside a jitted program, runs on the host CPU (on a GPU, XLA offloads it
    there) with its outputs in host memory. Its arguments should be in host memory already (`to_host`). Make it
    once per function and reuse it: on jax 0.10, one made afresh at every call inside a step lost the host
    placement (the H100-target compile of host miss mode then no longer put the computation on the host)."""
    if _COMPUTE_ON_IS_A_TRANSFORM:
        return transformed_at_each_call(fn, compute_on_module.compute_on)
    jitted = jax.jit(fn)

    def on_host(*args):
        with compute_on_module.compute_on("device_host"):
            return jitted(*args)

    return on_host


def transformed_at_each_call(fn, compute_on, compute_type: str = "device_host",
                              out_memory_space=jax.memory.Space.Host):
    """`fn` under the function transform `compute_on` (jax 0.11's compute_on, jax 0.10's compute_on2), applied
    afresh at every call. The transform caches its trace by the function it wraps, so one transformed function
    called at several places of a step (each layer's host misses) lowered to one host computation with several
    callers, and XLA:GPU aborted compiling it ("HLO opcode `async-start` is not supported by XLA:CPU", jax 0.11.2 on
    a lent H100, 2026-11-27). A fresh wrapper per call gives every call site its own computation, the form that ran
    there on 2026-11-26. Every output goes to `out_memory_space`."""

    def transformed(*args):
        return compute_on(functools.partial(fn), compute_type=compute_type, out_memory_spaces=out_memory_space)(*args)

    return transformed


def on_second_stream(fn):
    """`fn` as a function that, called inside a jitted program for a GPU, runs as an asynchronous call on a stream
    of its own (XLA:GPU's stream annotation, compute_on "gpu_stream:1"): the compute stream's kernels that XLA
    schedules between the call's start and its done run beside it. Its outputs stay on the device."""
    transform = compute_on_module.compute_on if _COMPUTE_ON_IS_A_TRANSFORM else compute_on_module.compute_on2
    return transformed_at_each_call(fn, transform, "gpu_stream:1", jax.memory.Space.Device)
