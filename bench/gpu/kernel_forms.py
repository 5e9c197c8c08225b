"""A one-row step's expert FFN in its two forms, timed side by side against the bytes it must read: the
matrix-vector programs a decode step of one sequence runs (jmoe.kernels.pallas_grouped, one_row: a program per
(choice, output block), no tile layout, the down projection split over f) and the row tiles every other step runs
(the row gathered into 16-row tiles, 15 of them padding). Issue #54 item 5: the first has two kernels fewer a MoE
layer (one more where the split down projection's parts are summed); this says whether its programs read the
weights faster.

Per layer shape (a cache-slot buffer of S experts, top-k distinct slots chosen, as a decode step's): each form's
median microseconds a call (a jitted call per iteration, dispatch included, as a step's kernels are launched), the
weight bytes the k experts hold over that time (GB/s), and that against the device's read bandwidth measured in the
same run (bench.helpers.common.read_bandwidth_gbs, a jitted sum: the bound of a kernel that reads its weights once);
and the two forms' largest difference relative to the tiles' output.
"""

from __future__ import annotations

import numpy as np

from bench.helpers.common import error_text, median_seconds, one_expert_bytes, read_bandwidth_gbs

# (name, slots, d, f, top-k, expert format): gpu_check's Mixtral-shaped layer, and GPT-OSS-120B's (MXFP4 experts with
# biases, its clamped SwiGLU) at a cache of 8 slots (the bytes a call reads depend on top-k, not on the slots).
GPT_OSS_ACTIVATION = "clamped_swiglu:7.0:1.702"  # jmoe.config's name for GPT-OSS's (its limit and alpha)
SHAPES = (("mixtral-shaped, bf16", 8, 2048, 7168, 2, None, "swiglu"),
          ("gpt-oss-120b-shaped, mxfp4", 8, 2880, 2880, 4, "mxfp4", GPT_OSS_ACTIVATION))
SMALL_SHAPES = (("small, bf16", 4, 64, 64, 2, None, "swiglu"),
                ("small, mxfp4", 4, 64, 64, 2, "mxfp4", GPT_OSS_ACTIVATION))
CALLS = 50  # per timing: a call is tens of microseconds on a GPU, so each timing is many


def layer_inputs(slots: int, d: int, f: int, top_k: int, fmt: str | None, seed: int = 0):
    """x [1, d], slot_ids [1, k] (distinct slots), weights [1, k], w_gate_up, w_down and biases (mxfp4: GPT-OSS's),
    drawn on the device."""
    import jax
    import jax.numpy as jnp

    from bench.gpu.in_memory import MXFP4_SCALE_BYTE
    from jmoe.kernels.quantized import QuantizedTensor

    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (1, d), jnp.bfloat16)
    slot_ids = jnp.arange(top_k, dtype=jnp.int32)[None, :] % slots
    weights = jnp.full((1, top_k), 1.0 / top_k, jnp.float32)

    def weight(key, k, n):
        if fmt is None:
            return (jax.random.normal(key, (slots, k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        group = 32  # MXFP4's block of K
        codes = jax.random.bits(key, (slots, k // 2, n), jnp.uint8)
        return QuantizedTensor(codes, jnp.full((slots, k // group, n), MXFP4_SCALE_BYTE, jnp.uint8), fmt, group)

    biases = (jnp.zeros((slots, 2 * f), jnp.bfloat16), jnp.zeros((slots, d), jnp.bfloat16)) if fmt else (None, None)
    return x, slot_ids, weights, weight(keys[1], d, 2 * f), weight(keys[2], f, d), *biases


def median_us(fn, args, calls: int) -> float:
    """Median over 5 timings of the microseconds a call of the jitted `fn` takes, `calls` calls each."""
    import jax

    def many():
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)

    return median_seconds(many, 5) / calls * 1e6


def forms_table(results: dict, size_header: str) -> list[str]:
    """The Markdown table of a probe that times a computation's forms over shapes (attention_forms,
    projection_forms): per shape its bytes (`mb_read`, under `size_header`), each form's us a call and share of the
    read bandwidth, and the largest difference of a later form from the first's; a failed shape says why."""
    shapes = results["shapes"].values()
    forms = next((list(row)[1:] for row in shapes if "failed" not in row), [])
    lines = [f"| shape | {size_header} | " + " | ".join(f"{form} us (share of HBM)" for form in forms)
             + f" | largest difference from {forms[0] if forms else 'the first'}'s |", "|---" * (len(forms) + 3) + "|"]
    for name, row in results["shapes"].items():
        if "failed" in row:
            lines.append(f"| {name} | **failed**: {row['failed'].replace('|', '/')} |" + " |" * len(forms))
            continue
        cells = [f"{row[form]['us']:.4g} ({row[form]['share_of_hbm']:.2f})" for form in forms]
        difference = max(row[form]["difference"] for form in forms[1:])
        lines.append(f"| {name} | {row['mb_read']:.4g} | " + " | ".join(cells) + f" | {difference:.2e} |")
    return lines


def one_row_forms(small: bool) -> dict:
    """Per shape: each form's us a call and GB/s of the chosen experts' bytes, the HBM bound's share, and the
    forms' difference (or why the shape failed: the others still run)."""
    bound = read_bandwidth_gbs(small)
    results = {"read_gbs": bound, "calls": CALLS, "shapes": {}}
    for name, *shape in SMALL_SHAPES if small else SHAPES:
        try:
            results["shapes"][name] = both_forms(*shape, bound=bound, calls=CALLS // (10 if small else 1))
        except Exception as error:  # recorded, as gpu_decode_bound records a setting that raises
            results["shapes"][name] = {"failed": error_text(error, 300)}
    return results


def both_forms(slots: int, d: int, f: int, top_k: int, fmt: str | None, activation: str, *, bound: float,
               calls: int) -> dict:
    """One layer shape's two forms timed, and their largest difference relative to the row tiles' output."""
    import functools

    import jax

    from jmoe.kernels.pallas_grouped import moe_ffn_pallas

    inputs = layer_inputs(slots, d, f, top_k, fmt)
    moved = top_k * one_expert_bytes(inputs[3:])  # the weights and biases
    row, outputs = {"mb_read": moved / 1e6}, {}
    for form, gemv in (("matrix-vector", True), ("row tiles", False)):
        fn = jax.jit(functools.partial(moe_ffn_pallas, activation=activation, one_row_gemv=gemv))
        outputs[form] = np.asarray(fn(*inputs), np.float32)
        us = median_us(fn, inputs, calls)
        row[form] = {"us": us, "gbs": moved / us / 1e3, "share_of_hbm": moved / us / 1e3 / bound}
    reference = outputs["row tiles"]
    row["relative_difference"] = float(np.abs(outputs["matrix-vector"] - reference).max()
                                       / max(np.abs(reference).max(), 1e-30))
    return row


def markdown(results: dict) -> list[str]:
    lines = [f"A one-row step's expert FFN, the two forms (jmoe.kernels.pallas_grouped; {results['calls']} jitted "
             f"calls a timing, median of 5): the chosen experts' bytes over the time, against the device's read "
             f"bandwidth, {results['read_gbs']:.4g} GB/s (a jitted sum).", "",
             "| layer | MB read | matrix-vector us | GB/s | share of HBM | row tiles us | GB/s | share of HBM "
             "| largest difference |", "|---" * 9 + "|"]
    for name, row in results["shapes"].items():
        if "failed" in row:
            lines.append(f"| {name} | **failed**: {row['failed'].replace('|', '/')} |" + " |" * 7)
            continue
        gemv, tiles = row["matrix-vector"], row["row tiles"]
        lines.append(f"| {name} | {row['mb_read']:.4g} | {gemv['us']:.4g} | {gemv['gbs']:.4g} | "
                     f"{gemv['share_of_hbm']:.2f} | {tiles['us']:.4g} | {tiles['gbs']:.4g} | "
                     f"{tiles['share_of_hbm']:.2f} | {row['relative_difference']:.2e} |")
    return lines
