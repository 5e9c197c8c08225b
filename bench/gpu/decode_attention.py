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
# The keys written: roped by XLA in both forms, but over the queries and keys together for the kernel, whose fusion
# may round a product-and-sum differently (a fused multiply-add): a unit in the last place of the largest value at
# most.
KEY_TOLERANCE = {"float32": 2.0 ** -22, "bfloat16": 2.0 ** -7}
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
# Latent attention (rows, cache rows, columns, heads, kv_lora_rank, rope dims, nope dims, value dims, interleaved
# rope pairs, dtype, columns per part): DeepSeek-V3's widths at a 4k cache in four parts; odd sizes in float32 (heads
# no multiple of a program's 16, a rank no power of two), in one part and in parts of 64 columns.
LATENT_CASES = [(1, 1, 4096, 128, 512, 64, 128, 128, True, "bfloat16", 1024),
                (3, 4, 200, 20, 48, 16, 12, 24, False, "float32", 1024),
                (2, 2, 300, 16, 64, 8, 8, 16, True, "float32", 64)]


def check(result, on_gpu: bool) -> None:
    """Each case a check of `result` (a SectionResult), whatever the time: a few small programs."""
    for case in CASES:
        result.attempt(f"attend_one_token kernel / (B, S, Hkv, G, hd) = {case[:1] + case[2:6]}, window {case[6]}, "
                       f"sinks {case[7]}, {case[8]}, parts of {case[9]}, {case[10]} dims rotated", None,
                       functools.partial(attention_agrees, case, on_gpu))
    for case in LATENT_CASES:
        result.attempt(f"attend_latent_one_token kernel / (B, S, H, r, dr) = {case[:1] + case[2:6]}, {case[9]}, "
                       f"parts of {case[10]}", None, functools.partial(latent_attention_agrees, case, on_gpu))


def random_columns(rng, rows: int, length: int, window: int | None):
    """(write_index int32 [B], mask bool [B, 1, S], columns int32 [B, 2]) of a decode step: each row's last column
    random in the cache's second half, its first past a random left padding and the window; row 0 (of several) sees
    no column (its padding past its token, as an idle serving row's can be); the last row (of three or more) writes
    past the cache."""
    import jax.numpy as jnp

    last = rng.integers(length // 2, length, rows)
    pad = rng.integers(0, last // 4 + 1)
    if rows > 1:
        pad[0] = last[0] + 1
    if rows > 2:
        last[-1] = length + 3
    first = pad if window is None else np.maximum(pad, last - (window - 1))
    cols = np.arange(length)
    mask = (cols >= first[:, None]) & (cols <= last[:, None])
    return (jnp.asarray(last, jnp.int32), jnp.asarray(mask[:, None, :]),
            jnp.asarray(np.stack([first, last], axis=1), jnp.int32))


def random_rope(rng, rows: int, rotated: int):
    """RoPE tables [B, 1, rotated] at random angles, each repeated over both halves as rope_tables makes them."""
    import jax.numpy as jnp

    from jmoe.model.rope import RoPE

    angles = rng.uniform(0, 2 * np.pi, (rows, 1, rotated // 2))
    angles = np.concatenate([angles, angles], axis=-1)
    return RoPE(jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))


def random_step(case, seed: int = 0):
    """(q, k, v, k_cache, v_cache, rope, write_index, mask, columns, sinks) of one decode step of `case` (q, k, v
    unroped; random_columns' rows)."""
    import jax.numpy as jnp

    rows, cache_rows, length, kv_heads, groups, head_dim, window, sinks, dtype, _, rotated = case
    rng = np.random.default_rng(seed + length)
    normal = functools.partial(_normal, rng, dtype)
    return (normal(rows, 1, kv_heads * groups, head_dim), normal(rows, 1, kv_heads, head_dim),
            normal(rows, 1, kv_heads, head_dim), normal(cache_rows, length, kv_heads, head_dim),
            normal(cache_rows, length, kv_heads, head_dim), random_rope(rng, rows, rotated),
            *random_columns(rng, rows, length, window),
            jnp.asarray(rng.normal(SINK_MEAN, 1.0, (kv_heads, groups)), jnp.float32) if sinks else None)


def _normal(rng, dtype, *shape, scale: float = 1.0):
    """A normal random array of `shape` and `dtype`, on the device."""
    import jax.numpy as jnp

    return jnp.asarray(rng.normal(0.0, scale, shape), dtype)


def random_latent_step(case, seed: int = 0):
    """(q, latent, k_rope, latent_cache, rope_cache, kv_b, rope, write_index, mask, columns), MLA of a
    latent-attention decode step of `case` (random_columns' rows)."""
    from jmoe.config import MLA

    rows, cache_rows, length, heads, rank, rope_dim, nope_dim, value_dim, interleaved, dtype, _ = case
    rng = np.random.default_rng(seed + length)
    normal = functools.partial(_normal, rng, dtype)
    mla = MLA(q_lora_rank=0, kv_lora_rank=rank, qk_nope_head_dim=nope_dim, qk_rope_head_dim=rope_dim,
              v_head_dim=value_dim, rope_interleave=interleaved, softmax_scale=(nope_dim + rope_dim) ** -0.5)
    step = (normal(rows, 1, heads, nope_dim + rope_dim), normal(rows, 1, 1, rank),
            normal(rows, 1, 1, rope_dim), normal(cache_rows, length, 1, rank), normal(cache_rows, length, 1, rope_dim),
            normal(heads * (nope_dim + value_dim), rank, scale=rank ** -0.5), random_rope(rng, rows, rope_dim),
            *random_columns(rng, rows, length, None))
    return step, mla


def attention_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the kernel's output and caches agree with the XLA form's for a CASES case, how far apart)."""
    from jmoe.model.attention import one_token_by_kernel, written_and_attended

    *inputs, sinks = random_step(case)
    forms = dict(sinks=sinks, scale=case[5] ** -0.5)
    return forms_agree(functools.partial(written_and_attended, **forms),
                       functools.partial(one_token_by_kernel, on_gpu=on_gpu, columns_per_part=case[9], **forms),
                       inputs, case[8])


def latent_attention_agrees(case, on_gpu: bool) -> tuple[bool, str]:
    """(whether the latent kernel's output and caches agree with the XLA form's for a LATENT_CASES case, how far)."""
    from jmoe.model.mla import latent_one_token_by_kernel, latent_written_and_attended

    inputs, mla = random_latent_step(case)
    return forms_agree(functools.partial(latent_written_and_attended, mla=mla),
                       functools.partial(latent_one_token_by_kernel, mla=mla, on_gpu=on_gpu, columns_per_part=case[10]),
                       inputs, case[9])


def forms_agree(xla_form, kernel_form, inputs, dtype: str) -> tuple[bool, str]:
    """(whether two forms' (out, *caches) agree on `inputs`, whose last two are write_index [B] and columns [B, 2]:
    outputs within TOLERANCE of the dtype, the caches' written columns within KEY_TOLERANCE and every other entry
    equal; how far apart)."""
    import jax

    want, got = jax.jit(xla_form)(*inputs), jax.jit(kernel_form)(*inputs)
    # A row that sees no column is padding, whose output nothing reads: XLA's is the mean of every value column (its
    # scores all equally masked), the kernel's zeros.
    columns = np.asarray(inputs[-1])
    sees = columns[:, 0] <= columns[:, 1]
    out, want_out = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    error = float(np.abs(out[sees] - want_out[sees]).max())
    blind_zero = not np.any(out[~sees])
    cache_error = max(_written_difference(np.asarray(g, np.float32), np.asarray(w, np.float32), columns[:, 1])
                      for g, w in zip(got[1:], want[1:]))
    return (cache_error <= KEY_TOLERANCE[dtype] and blind_zero and error <= TOLERANCE[dtype],
            f"caches' written columns differ by {cache_error:.1e} (of their largest), outputs by {error:.1e}"
            + ("" if blind_zero else ", a row that sees nothing not zeros"))


def _written_difference(got: np.ndarray, want: np.ndarray, written: np.ndarray) -> float:
    """The largest difference of two caches [Bc, S, ...] at each row's written column (written[b] for row b, if
    inside), relative to the largest value written; inf if they differ anywhere else."""
    rows = np.flatnonzero(written < got.shape[1])
    at = (rows, written[rows])
    outside = np.ones(got.shape[:2], bool)
    outside[at] = False
    if not np.array_equal(got[outside], want[outside]):
        return float("inf")
    return float(np.abs(got[at] - want[at]).max(initial=0.0) / max(np.abs(want[at]).max(initial=0.0), 1e-30))
