"""jmoe.plan compiles jmoe's decode and prefill programs for an H100 on this CPU machine, in child processes,
for every supported family (one tiny checkpoint each, from tests/hf_models.py FAMILY_CASES)."""

import pytest

import jmoe
from hf_models import FAMILY_CASES
from jmoe.plan.programs import PLUGIN_HINT, plugin_available

pytestmark = pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)

# The first case of every family, each with a different placement.
FAMILIES = list({model_type: name for name, (model_type, _) in reversed(FAMILY_CASES.items())}.values())[::-1]
PLACEMENTS = [dict(cache=1, offload_params=["attn"]), dict(cache=2, prefetch=1),
              dict(cpu_moe_layers=1, offload_group_size=2), dict()]


@pytest.mark.parametrize("case", FAMILIES)
def test_decode_and_prefill_compile_for_h100(case, hf_checkpoints):
    options = PLACEMENTS[FAMILIES.index(case) % len(PLACEMENTS)]
    plan = jmoe.plan(hf_checkpoints[case][0], target="h100", context=64, batch=2, **options)
    needs = plan.needs
    for name, tokens in (("decode", (2, 1)), ("prefill", (2, 64))):
        program = plan.programs[name]
        assert program.error is None, program.error
        assert program.tokens == tokens
        memory = program.memory_analysis
        # Pinned-host experts are host arguments of the compiled program, everything else is on the device.
        assert memory["host_argument_size_in_bytes"] == needs.host_bytes
        resident = needs.device_weight_bytes + needs.slot_bytes + needs.kv_bytes
        assert resident <= memory["argument_size_in_bytes"] < resident + 2**16  # + tokens, tables, key
        assert program.device_bytes >= resident
        hlo = program.hlo_text
        assert hlo.startswith("HloModule") and "ENTRY" in hlo
        assert (":S(5)}" in hlo) == (needs.host_bytes > 0)  # host memory space in the optimized HLO
    assert needs.program_bytes == max(p.device_bytes for p in plan.programs.values())
    assert plan.fits and plan.as_dict()["device_bytes_include_programs"]


def test_a_compiler_process_that_dies_becomes_an_error_of_that_program(hf_checkpoints):
    """Host miss mode's decode step computes misses on the host, which aborts XLA:GPU's compile-only path in
    jax 0.10 (`async-start` is not supported by XLA:CPU's thunk emitter): the child process dies, the plan
    reports it and falls back to the bytes it knows without that program. Prefill streams its experts in
    every miss mode, so it compiles."""
    plan = jmoe.plan(hf_checkpoints[FAMILIES[0]][0], target="h100", context=32, cache=1, miss_mode="host")
    assert "exited with status" in plan.programs["decode"].error
    assert "async-start" in plan.programs["decode"].error
    assert any(note.startswith("decode program: not compiled") for note in plan.notes)
    assert plan.programs["prefill"].error is None
    # What is known: the prefill program's memory, and the estimate.
    assert plan.needs.program_bytes == plan.programs["prefill"].device_bytes
    assert plan.needs.device_bytes == max(plan.needs.estimate_bytes, plan.needs.program_bytes)
