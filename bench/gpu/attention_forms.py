"""A decode step's attention in its two forms, timed side by side against the bytes it must read: XLA's (the cache
written, then every column of it read and masked: jmoe.model.attention.written_and_attended) and the kernel's (the
columns a row sees read, in parts of COLUMNS_PER_PART columns whose partial softmaxes are combined after:
jmoe.kernels.decode_attention) at a few part sizes. Issue #54 item 5: the kernel is one launch a layer where XLA's
is five; this says whether it also reads the cache as fast, and which part size spreads a long context best.

Per shape (a layer's cache of S columns, of which each row sees the last `visible`: its whole context or its window):
each form's median microseconds a call (a jitted call per iteration, its caches donated and passed on, as a step's
are), the bytes of the visible keys and values over that time (GB/s) against the device's read bandwidth measured in
the same run (bench.helpers.common.read_bandwidth_gbs), and each kernel form's largest difference from XLA's output.
"""

from __future__ import annotations

import time

import numpy as np

from bench.gpu.kernel_forms import forms_table
from bench.helpers.common import error_text, read_bandwidth_gbs

# (name, rows, cache columns, filled columns, kv heads, query heads per kv head, head dim, window, sinks): Mixtral's
# attention at a quarter-filled 4k cache and a full 32k one, one row; GPT-OSS's (64-wide heads, sinks) for 8 rows
# at 8k, full and in its 128-column window.
SHAPES = (("mixtral-shaped, 1 row, 1k of 4k", 1, 4096, 1024, 8, 4, 128, None, False),
          ("mixtral-shaped, 1 row, 32k of 32k", 1, 32768, 32768, 8, 4, 128, None, False),
          ("gpt-oss-shaped, 8 rows, 8k", 8, 8192, 8192, 8, 8, 64, None, True),
          ("gpt-oss-shaped, 8 rows, 8k, window 128", 8, 8192, 8192, 8, 8, 64, 128, True))
SMALL_SHAPES = (("small, 1 row", 1, 256, 100, 2, 4, 32, None, False),
                ("small, 2 rows, window 16", 2, 256, 256, 2, 2, 32, 16, True))
PART_SIZES = (256, 1024, 4096)  # the kernel's columns per part, timed side by side
SMALL_PART_SIZES = (64, 256)
CALLS = 50  # per timing: a call is tens of microseconds on a GPU


def attention_forms(small: bool) -> dict:
    """Per shape: XLA's and each kernel part size's us a call, GB/s of the visible keys and values, the share of
    the read bandwidth, the kernel's difference from XLA (or why the shape failed: the others still run)."""
    bound = read_bandwidth_gbs(small)
    calls = CALLS // (10 if small else 1)
    results = {"read_gbs": bound, "calls": calls, "shapes": {}}
    for name, *shape in SMALL_SHAPES if small else SHAPES:
        try:
            results["shapes"][name] = all_forms(*shape, part_sizes=SMALL_PART_SIZES if small else PART_SIZES,
                                                bound=bound, calls=calls, on_gpu=not small)
        except Exception as error:  # recorded, as gpu_decode_bound records a setting that raises
            results["shapes"][name] = {"failed": error_text(error, 300)}
    return results


def step_inputs(rows, length, filled, kv_heads, groups, head_dim, window, sinks):
    """(q, k, v, k_cache, v_cache, rope, write_index, mask, columns), sinks of one decode step, drawn on the device:
    every row's token at column filled - 1."""
    import functools

    import jax
    import jax.numpy as jnp

    from jmoe.model.rope import RoPE

    keys = jax.random.split(jax.random.key(0), 7)
    normal = functools.partial(jax.random.normal, dtype=jnp.bfloat16)
    last = filled - 1
    first = 0 if window is None else max(0, last - (window - 1))
    cols = jnp.arange(length)
    mask = jnp.broadcast_to((cols >= first) & (cols <= last), (rows, 1, length))
    columns = jnp.broadcast_to(jnp.asarray([first, last], jnp.int32), (rows, 2))
    angles = jax.random.uniform(keys[6], (rows, 1, head_dim), jnp.float32, 0, 6.3)
    step = (normal(keys[0], (rows, 1, kv_heads * groups, head_dim)), normal(keys[1], (rows, 1, kv_heads, head_dim)),
            normal(keys[2], (rows, 1, kv_heads, head_dim)), normal(keys[3], (rows, length, kv_heads, head_dim)),
            normal(keys[4], (rows, length, kv_heads, head_dim)), RoPE(jnp.cos(angles), jnp.sin(angles)),
            jnp.asarray(last, jnp.int32), mask, columns)
    return step, (jax.random.normal(keys[5], (kv_heads, groups), jnp.float32) if sinks else None)


def all_forms(rows, length, filled, kv_heads, groups, head_dim, window, sinks, *, part_sizes, bound: float,
              calls: int, on_gpu: bool) -> dict:
    """One shape's forms timed, and each kernel form's largest difference from XLA's output."""
    import functools

    import jax

    from jmoe.model.attention import one_token_by_kernel, written_and_attended

    step, sink_logits = step_inputs(rows, length, filled, kv_heads, groups, head_dim, window, sinks)
    visible = filled if window is None else min(window, filled)
    read = rows * visible * kv_heads * head_dim * 2 * step[3].dtype.itemsize  # keys and values
    forms = {"xla": functools.partial(written_and_attended, sinks=sink_logits, scale=head_dim ** -0.5)}
    for part in part_sizes:
        forms[f"kernel, parts of {part}"] = functools.partial(one_token_by_kernel, sinks=sink_logits,
                                                              scale=head_dim ** -0.5, on_gpu=on_gpu,
                                                              columns_per_part=part)
    row, outputs = {"mb_read": read / 1e6}, {}
    for form, fn in forms.items():
        us, outputs[form] = time_form(jax.jit(fn, donate_argnums=(3, 4)), step, calls)
        row[form] = {"us": us, "gbs": read / us / 1e3, "share_of_hbm": read / us / 1e3 / bound}
    for form in list(forms)[1:]:
        row[form]["difference"] = float(np.abs(outputs[form] - outputs["xla"]).max())
    return row


def time_form(fn, step, calls: int) -> tuple[float, np.ndarray]:
    """(median us a call over 5 timings of `calls` calls, the first call's output): each call takes the caches the
    last returned (donated), as a decode step's layers do."""
    import jax

    q, k, v, k_cache, v_cache, *rest = step
    k_cache, v_cache = k_cache.copy(), v_cache.copy()  # the step's own are kept for the other forms
    out, k_cache, v_cache = fn(q, k, v, k_cache, v_cache, *rest)
    first = np.asarray(out, np.float32)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out, k_cache, v_cache = fn(q, k, v, k_cache, v_cache, *rest)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / calls * 1e6, first


def markdown(results: dict) -> list[str]:
    return [f"A decode step's attention, XLA's form and the kernel's at a few part sizes (jmoe.kernels."
            f"decode_attention; {results['calls']} jitted calls a timing, caches donated, median of 5): the visible "
            f"keys' and values' bytes over the time, against the device's read bandwidth, {results['read_gbs']:.4g} "
            f"GB/s (a jitted sum).", "", *forms_table(results, "MB visible")]
