"""Whether a copy the host issues outside a step runs beside it: the primitive of issue #54 item 4's first design
(the manager issuing jax.device_put of the experts it predicts before it dispatches the step that needs them),
measured before that design is built.

A copy of expert-sized bytes from each source the manager could hold them in, and a compute program of about the
copy's length (a chain of matmuls, no input from the copy), timed alone and issued together in three orders:
- "copy, then compute": the copy issued before the program is dispatched;
- "compute, then copy": issued after it (XLA's source says a transfer waits for the computations already enqueued);
- "between two steps": program, copy, program: what run-ahead dispatch would do (the copy for the step after next,
  issued while the next one is queued), which overlaps at best the second program.
Each order's overlap share = (serial time - measured) / (serial time - fully overlapped time): 1 is a copy hidden
entirely, 0 one that ran after or before the compute, negative slower than both in turn. Sources: a pinned-host array
of its own (what jmoe's experts would need to be, one array each); the same bytes as a NumPy array (pageable
memory); one expert indexed out of a stacked pinned-host array, as jmoe holds a layer's experts (indexing is a
program, on the compute stream); and, where JAX gives one without a copy, a row of a NumPy view of that stacked
pinned array (the design without a second copy of the experts: is a put from it a pinned transfer?).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from bench.gpu.speed import plain_copy_bytes
from bench.helpers.common import error_text, median_seconds

MATMUL_WIDTH = 4096  # bf16 [n, n] products: ~0.1 TFLOP each, a few hundred microseconds on an H100 (small: 256)
ORDERS = ("copy, then compute", "compute, then copy", "between two steps")


def overlap_share(order: str, copy_ms: float, compute_ms: float, measured_ms: float) -> float:
    """How much of the copy an order hid behind compute: 1 hidden entirely, 0 serial (see the module's docstring)."""
    computes = 2 if order == "between two steps" else 1
    serial = computes * compute_ms + copy_ms
    overlapped = (computes - 1) * compute_ms + max(compute_ms, copy_ms)
    return (serial - measured_ms) / max(serial - overlapped, 1e-9)


def busy_program(small: bool):
    """A jitted compute of `repeats` chained matmuls on the device (static repeats, so a loop of known trip count), and
    its inputs."""
    import jax
    import jax.numpy as jnp

    width = MATMUL_WIDTH // (16 if small else 1)

    @functools.partial(jax.jit, static_argnums=2)
    def busy(x, w, repeats):
        return jax.lax.fori_loop(0, repeats, lambda _, y: jnp.tanh(y @ w), x)  # tanh keeps the values bounded

    key = jax.random.key(0)
    x = jax.random.normal(key, (width, width), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (width, width), jnp.bfloat16) / width ** 0.5
    return busy, x, w


def device_put_overlap(small: bool) -> dict:
    """Per source: the copy's ms and GB/s, how long the device_put call holds the host, and each order's ms and
    overlap share against a compute program calibrated to about the copy's length."""
    import jax

    from jmoe.memory import DEVICE, PINNED_HOST, sharding_for

    size = plain_copy_bytes(small)
    values = np.ones(size // 4, np.float32)
    stacked = jax.device_put(np.stack([values, values]), sharding_for(PINNED_HOST))
    sources = {"own pinned-host array": jax.device_put(values, sharding_for(PINNED_HOST)),
               "NumPy array (pageable)": values}
    copies = {name: (lambda source=source: jax.device_put(source, sharding_for(DEVICE))) for name, source in
              sources.items()}
    copies["one of a stacked pinned-host array"] = lambda: jax.device_put(stacked[1], sharding_for(DEVICE))
    view, how = pinned_numpy_view(stacked)
    if view is not None:
        copies["row of a NumPy view of a stacked pinned-host array"] = lambda: jax.device_put(view[1],
                                                                                             sharding_for(DEVICE))

    busy, x, w = busy_program(small)
    one_ms = 1e3 * median_seconds(lambda: busy(x, w, 8).block_until_ready(), 3) / 8
    results = {"copy_mb": size / 1e6, "matmul_width": x.shape[0], "pinned_numpy_view": how, "sources": {}}
    for name, copy in copies.items():
        try:
            results["sources"][name] = source_overlap(copy, functools.partial(busy, x, w), one_ms, size)
        except Exception as error:  # recorded (indexing a pinned-host array may not run on a GPU): the rest still run
            results["sources"][name] = {"failed": error_text(error, 300)}
    return results


def source_overlap(copy, busy, one_ms: float, size: int) -> dict:
    """One source's copy timed alone, beside `busy(repeats)` (a compute of about its length) in each order, and
    how long issuing it holds the host."""
    import jax

    copy_ms = 1e3 * median_seconds(lambda: copy().block_until_ready(), 5)
    repeats = max(1, round(copy_ms / max(one_ms, 1e-6)))
    compute_ms = 1e3 * median_seconds(lambda: busy(repeats).block_until_ready(), 5)
    orders = {
        "copy, then compute": lambda: (copy(), busy(repeats)),
        "compute, then copy": lambda: (busy(repeats), copy()),
        "between two steps": lambda: (busy(repeats), copy(), busy(repeats)),
    }
    row = {"copy_ms": copy_ms, "gbs": size / copy_ms / 1e6, "call_returns_ms": call_ms(copy), "compute_ms": compute_ms,
           "orders": {}}
    for order in ORDERS:
        measured = 1e3 * median_seconds(lambda run=orders[order]: jax.block_until_ready(run()), 5)
        row["orders"][order] = {"ms": measured, "overlap_share": overlap_share(order, copy_ms, compute_ms, measured)}
    return row


def pinned_numpy_view(array) -> tuple[np.ndarray | None, str]:
    """A NumPy array sharing the pinned-host `array`'s memory and how it was made, or None and why not (each way
    tried: an error, or a copy)."""
    pointer = array.addressable_shards[0].data.unsafe_buffer_pointer()
    tried = []
    for name, make in (("np.from_dlpack", np.from_dlpack), ("np.asarray", np.asarray)):
        try:
            view = make(array)
        except Exception as error:  # recorded: which way JAX offers is the finding
            tried.append(f"{name}: {error_text(error, 200)}")
            continue
        if view.ctypes.data == pointer:
            return view, name
        tried.append(f"{name}: a copy")
    return None, "; ".join(tried)


def call_ms(copy) -> float:
    """Median ms until device_put returns (not until its bytes arrive): how long issuing it holds the manager."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        out = copy()
        times.append(time.perf_counter() - start)
        out.block_until_ready()
    return 1e3 * float(np.median(times))


def markdown(results: dict) -> list[str]:
    """The report's lines: a table of sources by order."""
    lines = [f"Copies issued outside the step (item 4's first design): {results['copy_mb']:.0f} MB by jax.device_put, "
             f"against a chain of [{results['matmul_width']}]^2 bf16 matmuls of about the copy's length; overlap "
             "share 1 = the copy hidden behind the compute, 0 = serial. A NumPy view of pinned-host memory: "
             f"{results['pinned_numpy_view']}.", "",
             "| source | copy ms | GB/s | call returns ms | compute ms | " + " | ".join(
                 f"{order} ms (share)" for order in ORDERS) + " |", "|---" * (5 + len(ORDERS)) + "|"]
    for name, row in results["sources"].items():
        if "failed" in row:
            lines.append(f"| {name} | **failed**: {row['failed'].replace('|', '/')} |" + " |" * (3 + len(ORDERS)))
            continue
        lines.append(f"| {name} | {row['copy_ms']:.3g} | {row['gbs']:.3g} | {row['call_returns_ms']:.3g} | "
                     f"{row['compute_ms']:.3g} | " + " | ".join(
                         f"{row['orders'][order]['ms']:.3g} ({row['orders'][order]['overlap_share']:.2f})"
                         for order in ORDERS) + " |")
    return lines
