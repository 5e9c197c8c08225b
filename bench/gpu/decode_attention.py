"""bench.gpu_check's check of the decode-attention kernel (jmoe.kernels.decode_attention, Triton on a GPU,
interpreted elsewhere) against the XLA form every other platform runs (jmoe.model.attention.written_and_attended),
on random inputs: rows at different columns with left padding, a row that sees nothing, a write past the cache,
windows and sinks, caches of more rows than the step, one part and several. The caches it writes must be equal; its
output within the tolerance of its dtype (it normalises after the product with the values, XLA before)."""

from __future__ import annotations

import functools

import numpy as np

# Largest difference from the XLA form: float32 products in another order; bfloat16 outputs (a unit in their last
# place is 2^-8 of a value) whose probabilities are rounded before normalisation instead of after.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
# (rows, cache rows, columns, kv heads, query heads per kv head, head dim, window, sinks, dtype, columns per part,
# rotated dims): Mixtral's heads at a 4k cache in four parts; GPT-OSS's (64-wide heads, a 128 window, sinks) for a
# serving batch of 4 in a cache of 8 rows; odd sizes in float32, half of each head rotated (GLM-4.5's partial
# rotary), with a window and sinks in one part and in parts of 64 columns.
CASES = [(1, 1, 4096, 8, 4, 128, None, False, "bfloat16", 1024, 128),
         (4, 8, 1000, 8, 8, 64, 128, True, "bfloat16", 1024, 64),
         (2, 2, 300, 4, 1, 80, None, False, "float32", 1024, 40),
         (3, 4, 200, 2, 3, 80, 50, True, "float32", 1024, 40),
         (3, 4, 200, 2, 3, 80, 50, True, "float32", 64, 80)]
# Sink logits: large enough that a sink takes a visible share of a window's softmax.
SINK_MEAN = 2.0


def check(result, on_gpu: bool) -> None:
    """Each case a check of `result` (a SectionResult), whatever the time: a few small programs."""
    for case in CASES:
        result.attempt(f"attend_one_token kernel / (B, S, Hkv, G, hd) = {case[:1] + case[2:6]}, window {case[6]}, "
                       f"sinks {case[7]}, {case[8]}, parts of {case[9]}, {case[10]} dims rotated", None,
                       functools.partial(attention_agrees, case, on_gpu))


def random_step(case, seed: int = 0):
    """(q, k, v, k_cache, v_cache, rope, write_index, mask, columns, sinks) of one decode step of `case` (q, k, v
    unroped, rope at random positions): each row's last
    column random in the cache's second half, its first past a random left padding and the window; row 0 (of
    several) sees no column (its padding past its token, as an idle serving row's can be); the last row (of three
    or more) writes past the cache."""
    import jax.numpy as jnp

    from jmoe.model.rope import RoPE

    rows, cache_rows, length, kv_heads, groups, head_dim, window, sinks, dtype, _, rotated = case
    rng = np.random.default_rng(seed + length)
    last = rng.integers(length // 2, length, rows)
    pad = rng.integers(0, last // 4 + 1)
    if rows > 1:
        pad[0] = last[0] + 1
    if rows > 2:
        last[-1] = length + 3
    first = pad if window is None else np.maximum(pad, last - (window - 1))
    cols = np.arange(length)
    mask = (cols >= first[:, None]) & (cols <= last[:, None])
    as_array = functools.partial(jnp.asarray, dtype=dtype)
    angles = rng.uniform(0, 2 * np.pi, (rows, 1, rotated // 2))
    angles = np.concatenate([angles, angles], axis=-1)  # as rope_tables makes them
    return (as_array(rng.standard_normal((rows, 1, kv_heads * groups, head_dim))),
            as_array(rng.standard_normal((rows, 1, kv_heads, head_dim))),
            as_array(rng.standard_normal((rows, 1, kv_heads, head_dim))),
            as_array(rng.standard_normal((cache_rows, length, kv_heads, head_dim))),
            as_array(rng.standard_normal((cache_rows, length, kv_heads, head_dim))),
            RoPE(jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)),
            jnp.asarray(last, jnp.int32), jnp.asarray(mask[:, None, :]),
            jnp.asarray(np.stack([first, last], axis=1), jnp.int32),
            jnp.asarray(rng.normal(SINK_MEAN, 1.0, (kv_heads, groups)), jnp.float32) if sinks else None)


def attention_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the kernel's output and caches agree with the XLA form's for a case, how far apart)."""
    import jax

    from jmoe.model.attention import one_token_by_kernel, written_and_attended

    *inputs, sinks = random_step(case)
    head_dim, dtype, columns_per_part = case[5], case[8], case[9]
    forms = dict(sinks=sinks, scale=head_dim ** -0.5)
    want = jax.jit(functools.partial(written_and_attended, **forms))(*inputs)
    got = jax.jit(functools.partial(one_token_by_kernel, on_gpu=on_gpu, columns_per_part=columns_per_part,
                                    **forms))(*inputs)
    # A row that sees no column is padding, whose output nothing reads: XLA's is the mean of every value column (its
    # scores all equally masked), the kernel's zeros.
    columns = np.asarray(inputs[-1])
    sees = columns[:, 0] <= columns[:, 1]
    out, want_out = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    error = float(np.abs(out[sees] - want_out[sees]).max())
    blind_zero = not np.any(out[~sees])
    caches_equal = all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got[1:], want[1:]))
    return (caches_equal and blind_zero and error <= TOLERANCE[dtype],
            f"caches {'equal' if caches_equal else 'differ'}, outputs differ by {error:.1e}"
            + ("" if blind_zero else ", a row that sees nothing not zeros"))
