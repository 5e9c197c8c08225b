"""Memory kinds: where a parameter lives. The one place that spells them.

`DEVICE` is accelerator memory; `PINNED_HOST` is page-locked host memory the accelerator can copy from
asynchronously (where offloaded experts live). Inside a jitted program the same places are addressed as
`jax.memory.Space.Device` / `jax.memory.Space.Host`.
"""

from __future__ import annotations

import jax

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
