"""Several processes and hosts through JAX's own runtime (`jax.distributed`): joining from explicit settings or
JAX's cluster detection, with bounded waits, and adding per-process results up.

Each process holds the whole model on its first local device (expert parallelism over a mesh, where each
process holds only its devices' experts, is not built yet); `jmoe.eval.evaluate` gives each process its share
of the windows and adds the sums, and generation gives the same tokens on every process.

What JAX does when a process is missing: joining waits up to `timeout_s`, and a process that stops sending
heartbeats for `timeout_s` ends every other process (JAX aborts them, naming the silent task), so no run hangs.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jmoe.arguments import is_whole_number
from jmoe.errors import JmoeError

AUTO = "auto"  # the coordinator JAX's cluster detection finds (SLURM, Open MPI, Kubernetes, Cloud TPU, ...)
DEFAULT_TIMEOUT_S = 120


class DistributedError(JmoeError):
    """The processes of a distributed run cannot start together (bad settings, coordinator unreachable)."""


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """coordinator: None (one process), "auto" (JAX detects the cluster) or "HOST:PORT" (process 0 hosts the
    coordination service there; every process names the same address, the same num_processes and its own
    process_id); timeout_s: how long to wait for every process to join, and for a silent process."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        explicit = self.coordinator not in (None, AUTO)
        if not explicit and (self.num_processes is not None or self.process_id is not None):
            raise DistributedError(f"--num-processes and --process-id go with --coordinator HOST:PORT, found them "
                                   f"with coordinator {self.coordinator!r}; add --coordinator or drop them")
        if explicit:
            host_and_port(self.coordinator)
            if not is_whole_number(self.num_processes) or self.num_processes < 1:
                raise DistributedError(f"--num-processes must be a whole number >= 1 with --coordinator, found "
                                       f"{self.num_processes!r}")
            if not is_whole_number(self.process_id) or not 0 <= self.process_id < self.num_processes:
                raise DistributedError(f"--process-id must be in [0, {self.num_processes}) (--num-processes "
                                       f"{self.num_processes}), found {self.process_id!r}; number the processes "
                                       f"0 to {self.num_processes - 1}")
        if not is_whole_number(self.timeout_s) or self.timeout_s < 1:
            raise DistributedError(f"the distributed timeout must be a whole number of seconds >= 1, found "
                                   f"{self.timeout_s!r}")


def host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.1:1234) or {AUTO!r}, found "
                               f"{address!r}")
    return host.strip("[]"), int(port)


def initialize(options: DistributedOptions) -> None:
    """Join the distributed run `options` describes (nothing for a single process). Before anything else that
    uses JAX: a process that is not the coordinator first waits (up to timeout_s) for the coordinator's port to
    answer, so an unreachable coordinator is a DistributedError naming it instead of JAX's abort."""
    if options.coordinator is None:
        return
    keep_standard_output_for_python()
    timeouts = {"initialization_timeout": options.timeout_s, "heartbeat_timeout_seconds": options.timeout_s}
    if options.coordinator == AUTO:
        jax.distributed.initialize(**timeouts)
        return
    if options.process_id != 0:
        _wait_for_port(*host_and_port(options.coordinator), options.timeout_s)
    print(f"jmoe: process {options.process_id} of {options.num_processes} joining at {options.coordinator} "
          f"(waiting up to {options.timeout_s} s for the others)", file=sys.stderr)
    jax.distributed.initialize(options.coordinator, options.num_processes, options.process_id, **timeouts)


def keep_standard_output_for_python() -> None:
    """From now on, file descriptor 1 goes to standard error and Python's `sys.stdout` writes to the original
    standard output. The CPU collectives (Gloo) print connection lines such as "[Gloo] Rank 1 is connected to 1
    peer ranks" on descriptor 1, from whichever collective first connects and from any thread, which would
    break a command's --json output; so for the whole run only what Python prints reaches standard output."""
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(original, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def _wait_for_port(host: str, port: int, timeout_s: int) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise DistributedError(f"the coordinator {host}:{port} did not answer within {timeout_s} s ({error}); "
                                       f"start process 0 (it hosts the coordinator) with the same --coordinator, "
                                       f"check the address and that the port is open") from None
            time.sleep(0.2)


def process_share(count: int, unit: int) -> slice:
    """This process's part of `count` items handed out in whole units of `unit` (e.g. windows in batches),
    contiguous and as even as units allow; every item belongs to exactly one process."""
    units = -(-count // unit)
    index, processes = jax.process_index(), jax.process_count()
    first, last = (units * index) // processes, (units * (index + 1)) // processes
    return slice(min(first * unit, count), min(last * unit, count))


def sum_over_processes(values: np.ndarray) -> np.ndarray:
    """`values` (float64 or integer NumPy, the same shape on every process) added up over all processes, in
    float64 / int64. Floats travel as a float32 pair (value, remainder), since JAX moves no float64 by default."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    if np.issubdtype(values.dtype, np.integer):
        if np.abs(values).max(initial=0) >= 2**31:
            raise DistributedError(f"sum_over_processes: integers up to 2**31 travel, found {np.abs(values).max()}")
        return _gather(values.astype(np.int32)).astype(np.int64).sum(axis=0)
    high = values.astype(np.float32)
    low = (values - high.astype(np.float64)).astype(np.float32)
    gathered = _gather(np.stack([high, low])).astype(np.float64)
    return gathered.sum(axis=(0, 1))


def _gather(values: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(values))  # [processes, ...]


def max_over_processes(value: float) -> float:
    """The largest of one float over all processes (e.g. the slowest process's wall time)."""
    if jax.process_count() == 1:
        return value
    return float(_gather(np.float32(value)).max())

