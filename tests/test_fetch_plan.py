"""Miss mode "fetch"'s bookkeeping as one kernel (jmoe.offload.fetch_plan, interpreted here as a GPU runs it lowered
to Triton) against the XLA computation every other platform runs, field by field."""

import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.offload.fetch_plan import fetch_plan_by_kernel, fetch_plan_fits
from jmoe.offload.slots import LayerSlots, fetch_plan_in_xla


def random_layer(rng, num_experts: int, num_cache: int, tokens: int, top_k: int):
    """Consistent tables with some empty slots, a victim order (a permutation of the slots, some left out) and the
    routing of a few tokens (distinct experts a token, the last token padding)."""
    expert_in_slot = np.full(num_cache, -1, np.int32)
    filled = rng.choice(num_cache, rng.integers(0, num_cache + 1), replace=False)
    expert_in_slot[filled] = rng.choice(num_experts, len(filled), replace=False)
    slot_of_expert = np.full(num_experts, -1, np.int32)
    slot_of_expert[expert_in_slot[filled]] = filled
    order = rng.permutation(num_cache).astype(np.int32)
    order[rng.random(num_cache) < 0.2] = -1
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    if tokens > 1:
        ids[-1] = -1
    slots = LayerSlots(None, jnp.asarray(slot_of_expert), jnp.asarray(expert_in_slot))
    return slots, jnp.asarray(order), jnp.asarray(ids)


# (experts, cache slots, tokens, top-k, scratch slots): one-row steps whose misses are all admitted or partly go to
# scratch, batches that repeat experts, more misses than scratch slots, sizes that are no powers of two.
CASES = [(8, 2, 1, 2, 2), (8, 4, 3, 2, 2), (60, 6, 2, 4, 3), (16, 3, 4, 3, 1), (32, 8, 1, 4, 4)]


@pytest.mark.quick
@pytest.mark.parametrize("experts,cache,tokens,top_k,scratch", CASES)
def test_the_kernel_plans_as_xla_does(experts, cache, tokens, top_k, scratch):
    rng = np.random.default_rng(experts * cache + tokens)
    most_needed = min(tokens * top_k, experts)
    for trial in range(6):
        slots, order, ids = random_layer(rng, experts, cache, tokens, top_k)
        all_admitted = cache >= most_needed and trial % 2 == 0  # the order names every slot
        if all_admitted:
            order = jnp.asarray(rng.permutation(cache).astype(np.int32))
        options = dict(most_missed=most_needed if all_admitted else min(scratch, most_needed), num_scratch=scratch)
        want = fetch_plan_in_xla(slots, order, ids, **options)
        got = fetch_plan_by_kernel(slots, order, ids, on_gpu=False, **options)
        for field, value in want._asdict().items():
            np.testing.assert_array_equal(getattr(got, field), value, err_msg=f"{field}, trial {trial}")


def test_large_steps_keep_xla_s_kernels():
    assert fetch_plan_fits(128, 40, 40, 4) and fetch_plan_fits(256, 16, 16, 8)
    assert not fetch_plan_fits(256, 16, 16, 64)  # a batch of 8 tokens of top-8 over 256 experts
    assert not fetch_plan_fits(8, 2, 0, 2)  # a static policy offers no victims
