"""Miss mode "fetch"'s bookkeeping as one kernel (jmoe.offload.fetch_plan, interpreted here as a GPU runs it lowered
to Triton) against the XLA computation every other platform runs, field by field."""

import pytest

from bench.gpu.bookkeeping import plan_agrees
from jmoe.offload.fetch_plan import fetch_plan_fits


# (experts, cache slots, tokens, top-k, scratch slots): one-row steps whose misses are all admitted or partly go to
# scratch, batches that repeat experts, more misses than scratch slots, sizes that are no powers of two.
CASES = [(8, 2, 1, 2, 2), (8, 4, 3, 2, 2), (60, 6, 2, 4, 3), (16, 3, 4, 3, 1), (32, 8, 1, 4, 4)]


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_plans_as_xla_does(case):
    agrees, detail = plan_agrees(case, on_gpu=False)  # bench.gpu_check's check, here with the kernel interpreted
    assert agrees, detail


def test_large_steps_keep_xla_s_kernels():
    assert fetch_plan_fits(128, 40, 40, 4) and fetch_plan_fits(256, 16, 16, 8)
    assert not fetch_plan_fits(256, 16, 16, 64)  # a batch of 8 tokens of top-8 over 256 experts
    assert not fetch_plan_fits(8, 2, 0, 2)  # a static policy offers no victims
