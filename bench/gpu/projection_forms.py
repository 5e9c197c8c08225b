"""A decode step's product with a large dense weight in its two forms, timed side by side against the bytes it must
read: XLA's (a GEMM of the rows padded to a tile, split over K, and a kernel summing the pieces:
jmoe.model.layers.projected_by_xla) and the kernel's (a program per block of outputs: jmoe.kernels.projection) at a
few block sizes. Issue #54 item 5: the kernel is one launch where XLA's is two; this says whether it also reads the
weight as fast, and which blocks do best.

Per shape: each form's median microseconds a call (a jitted call per iteration), the weight's bytes over that time
(GB/s) against the device's read bandwidth measured in the same run (bench.helpers.common.read_bandwidth_gbs), and
each kernel form's largest difference from XLA's output relative to its largest value.
"""

from __future__ import annotations

import numpy as np

from bench.gpu.kernel_forms import forms_table, median_us
from bench.helpers.common import error_text, read_bandwidth_gbs

# (name, rows, outputs, K, bias): GPT-OSS-120B's attention output for one row and for 8 serving rows (its bias);
# DeepSeek-V3's attention output and q_a for one row.
SHAPES = (("gpt-oss-120b attention output, 1 row", 1, 2880, 4096, True),
          ("gpt-oss-120b attention output, 8 rows", 8, 2880, 4096, True),
          ("deepseek-v3 attention output, 1 row", 1, 7168, 16384, False),
          ("deepseek-v3 q_a, 1 row", 1, 1536, 7168, False))
SMALL_SHAPES = (("small, 1 row", 1, 64, 300, True), ("small, 3 rows", 3, 40, 200, False))
BLOCKS = ((16, 256), (32, 256), (16, 512))  # the kernel's (outputs a program, columns a step), side by side
CALLS = 50  # per timing: a call is tens of microseconds on a GPU


def projection_forms(small: bool) -> dict:
    """Per shape: XLA's and each kernel block size's us a call, GB/s of the weight, the share of the read bandwidth,
    the kernel's difference from XLA (or why the shape failed: the others still run)."""
    bound = read_bandwidth_gbs(small)
    calls = CALLS // (10 if small else 1)
    results = {"read_gbs": bound, "calls": calls, "shapes": {}}
    for name, *shape in SMALL_SHAPES if small else SHAPES:
        try:
            results["shapes"][name] = all_forms(*shape, bound=bound, calls=calls, on_gpu=not small)
        except Exception as error:  # recorded, as gpu_decode_bound records a setting that raises
            results["shapes"][name] = {"failed": error_text(error, 300)}
    return results


def all_forms(rows: int, outputs: int, k: int, with_bias: bool, *, bound: float, calls: int, on_gpu: bool) -> dict:
    """One shape's forms timed, and each kernel form's largest difference from XLA's output."""
    import functools

    import jax
    import jax.numpy as jnp

    from jmoe.kernels.projection import projected_rows
    from jmoe.model.layers import projected_by_xla

    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    weight = (jax.random.normal(keys[1], (outputs, k), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    bias = jax.random.normal(keys[2], (outputs,), jnp.bfloat16) if with_bias else None
    read = weight.size * weight.dtype.itemsize
    forms = {"xla": projected_by_xla}
    for block_out, block_k in BLOCKS:
        forms[f"kernel, {block_out} x {block_k}"] = functools.partial(projected_rows, on_gpu=on_gpu,
                                                                      block_out=block_out, block_k=block_k)
    row, outputs_of = {"mb_read": read / 1e6}, {}
    for form, fn in forms.items():
        jitted = jax.jit(fn)
        outputs_of[form] = np.asarray(jitted(x, weight, bias), np.float32)
        us = median_us(jitted, (x, weight, bias), calls)
        row[form] = {"us": us, "gbs": read / us / 1e3, "share_of_hbm": read / us / 1e3 / bound}
    largest = max(float(np.abs(outputs_of["xla"]).max()), 1e-30)
    for form in list(forms)[1:]:
        row[form]["difference"] = float(np.abs(outputs_of[form] - outputs_of["xla"]).max()) / largest
    return row


def markdown(results: dict) -> list[str]:
    return [f"A decode step's product with a large dense weight, XLA's form and the kernel's at a few block sizes "
            f"(jmoe.kernels.projection; {results['calls']} jitted calls a timing, median of 5): the weight's bytes "
            f"over the time, against the device's read bandwidth, {results['read_gbs']:.4g} GB/s (a jitted sum).", "",
            *forms_table(results, "MB read")]
