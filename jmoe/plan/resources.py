"""Memory a plan is checked against: host RAM from the OS, the pinned-host pool JAX on GPU allows, and the
device memory of a target GPU, of the local accelerator, or given by the user.

Two JAX-on-GPU settings are read from the environment as XLA reads them when its GPU client starts:
- `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` caps the pinned-host pool (default 64 GiB; offloaded experts live
  there). It cannot change once JAX's GPU backend has started, so the command lines set it from the plan
  before JAX starts (`ensure_pinned_pool`).
- `XLA_CLIENT_MEM_FRACTION` (or the older `XLA_PYTHON_CLIENT_MEM_FRACTION`) is the share of device memory
  JAX's allocator may use (default 0.75; `XLA_PYTHON_CLIENT_ALLOCATOR=platform` allocates on demand).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from jmoe.errors import InputError

PINNED_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_PINNED_POOL_GB = 64
MEM_FRACTION_ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
DEFAULT_MEM_FRACTION = 0.75
POOL_HEADROOM = 1.05  # the pool's allocator rounds and fragments: ask for 5% more than the experts' bytes


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the plan may use. device_bytes None: the device is this machine's CPU, sharing host RAM."""

    host_bytes: int
    host_source: str
    device_bytes: int | None
    device_source: str
    pinned_pool_bytes: int | None  # None: not a GPU, no pinned pool
    pinned_pool_source: str = ""
    pinned_pool_set: bool = False  # the user set the limit (else it is XLA's default, which jmoe may raise)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def host_available_bytes() -> int:
    """RAM the OS says can be allocated without swapping (MemAvailable), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"),
                  root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, anonymous bytes in use) of the memory cgroup this process runs in (a container's memory cap, a
    systemd slice's MemoryMax): the tightest limit of it and its ancestors. None: no limit, or no memory controller
    mounted. cgroup v1's memory controller when it has one (a hybrid mount), else v2's."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: the stat file has the hierarchy's limit and usage
            stat = _stat_values(root / "memory" / path.lstrip("/") / "memory.stat")
            limit = stat.get("hierarchical_memory_limit")
            return None if limit is None or limit >= CGROUP_V1_NO_LIMIT else (limit, stat.get("total_rss", 0))
    for line in lines:
        if line.startswith("0::"):
            group = root / line[3:].strip().lstrip("/")
            limits = [int(v) for d in (group, *group.parents) if d.is_relative_to(root)
                      for v in [_first_word(d / "memory.max")] if v not in (None, "max")]
            anon = _stat_values(group / "memory.stat").get("anon", 0)
            return (min(limits), anon) if limits else None
    return None


CGROUP_V1_NO_LIMIT = 1 << 62  # v1 reports no limit as 2**63 - 1 rounded down to a page


def _stat_values(path: Path) -> dict[str, int]:
    try:
        return {name: int(value) for name, value in (line.split() for line in path.read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _first_word(path: Path) -> str | None:
    try:
        return path.read_text().split()[0]
    except (OSError, IndexError):
        return None


def page_cache_room(planned_bytes: int) -> tuple[int, str]:
    """(bytes the page cache can keep once this process has allocated `planned_bytes` more, what bounds it): what
    the machine has free or reclaimable (MemAvailable), or less within this process's memory cgroup limit."""
    room, source = host_available_bytes(), "MemAvailable of this machine"
    group = cgroup_memory()
    if group is not None and group[0] - group[1] < room:
        room = group[0] - group[1]
        source = f"its memory cgroup's limit of {group[0] / 1e9:.2f} GB, {group[1] / 1e9:.2f} GB of it in use"
    return max(room - planned_bytes, 0), source


def pinned_pool() -> tuple[int, str]:
    """(the pinned-host pool limit in bytes, where it comes from); `PINNED_POOL_ENV in os.environ` says
    whether the user set it."""
    value = os.environ.get(PINNED_POOL_ENV)
    if value is None:
        return DEFAULT_PINNED_POOL_GB * 2**30, f"XLA's default ({DEFAULT_PINNED_POOL_GB} GiB; {PINNED_POOL_ENV} unset)"
    try:
        gb = int(value)
    except ValueError:
        raise InputError(f"{PINNED_POOL_ENV}={value!r}: XLA reads a whole number of GiB; set it to one") from None
    return gb * 2**30, f"{PINNED_POOL_ENV}={gb}"


def pinned_pool_gb_for(host_bytes: int) -> int:
    """The pool limit, in whole GiB as XLA reads it, that holds `host_bytes` of pinned arrays."""
    return math.ceil(host_bytes * POOL_HEADROOM / 2**30)


def ensure_pinned_pool(host_bytes: int) -> str | None:
    """Before JAX's GPU backend starts: raise the pinned-host pool limit when `host_bytes` of pinned arrays
    need more than XLA's default and the user did not set it. Returns what was set (None: nothing)."""
    needed = pinned_pool_gb_for(host_bytes)
    if PINNED_POOL_ENV in os.environ or needed <= DEFAULT_PINNED_POOL_GB:
        return None
    os.environ[PINNED_POOL_ENV] = str(needed)
    return f"{PINNED_POOL_ENV}={needed}"


def memory_fraction() -> tuple[float, str]:
    """(share of device memory JAX's GPU allocator may use, where it comes from)."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform (allocates on demand)"
    for name in MEM_FRACTION_ENVS:
        if os.environ.get(name):
            try:
                return float(os.environ[name]), f"{name}={os.environ[name]}"
            except ValueError:
                raise InputError(f"{name}={os.environ[name]!r} is not a fraction; set it to e.g. 0.9") from None
    return DEFAULT_MEM_FRACTION, f"JAX's default {DEFAULT_MEM_FRACTION} ({MEM_FRACTION_ENVS[0]} unset)"


def local_device_bytes() -> tuple[int | None, str]:
    """(bytes JAX may allocate on this process's first device, where it comes from); None on a CPU backend,
    where "device" arrays live in host RAM next to the pinned ones. Starts JAX's backend."""
    import jax

    device = jax.local_devices()[0]  # jax.devices()[0] belongs to process 0 in a multi-process run
    if device.platform == "cpu":
        return None, "this machine's CPU (device arrays live in host RAM)"
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None:
        return None, f"{device.device_kind}: memory_stats() has no bytes_limit"
    return int(limit) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind}: free of JAX's bytes_limit"


def resources(target=None, host_gb: float | None = None, device_gb: float | None = None) -> Resources:
    """The memory to check a plan against. A target GPU (jmoe.plan.targets.Target) gives its device memory
    times JAX's allocator fraction; `device_gb` / `host_gb` (GiB) override what the target or this machine
    says. Without a target this machine's first device is used (starting JAX's backend)."""
    host = int(host_gb * 2**30) if host_gb is not None else host_available_bytes()
    host_source = f"host_gb={host_gb}" if host_gb is not None else "MemAvailable of this machine"
    if target is not None:
        fraction, fraction_source = memory_fraction()
        device = int(target.device_memory_bytes * fraction)
        device_source = (f"{target.name} ({target.device_kind}): {target.device_memory_bytes / 2**30:.2f} GiB x "
                         f"{fraction} ({fraction_source})")
    else:
        device, device_source = local_device_bytes()
    gpu = device is not None  # a target, or a local accelerator: arrays in pinned host memory use XLA's pool
    pool = (*pinned_pool(), PINNED_POOL_ENV in os.environ) if gpu else (None, "", False)
    if device_gb is not None:
        device, device_source = int(device_gb * 2**30), f"device_gb={device_gb}"
    return Resources(host, host_source, device, device_source, *pool)
