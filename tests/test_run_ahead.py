"""Steps dispatched before the last one is read back (Model.dispatch_step, generate's default): the host's work
between steps overlaps the device's next step, the manager's tables reach the step after next, and nothing about
the results changes. Issue #54 item 3."""

import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from jmoe.decode.sampling import SamplingParams
from jmoe.kernels import ExpertWeights
from jmoe.offload.engine import steps_run_ahead
from jmoe.offload.manager import SlotManager
from jmoe.offload.slots import LayerSlots, copy_wanted
from test_offload import PROMPTS, first_four_experts


def experts_valued(values) -> ExpertWeights:
    """One-number experts: both weights of row r hold values[r]."""
    column = jnp.asarray(values, jnp.float32)[:, None, None]
    return ExpertWeights(column, column)


def one_layer_slots(expert_in_slot: list[int], num_experts: int = 8) -> LayerSlots:
    """Slots that hold expert e as the value 100 + e (0: empty)."""
    held = np.asarray(expert_in_slot, np.int32)
    slot_of_expert = np.full(num_experts, -1, np.int32)
    slot_of_expert[held[held >= 0]] = np.flatnonzero(held >= 0)
    return LayerSlots(experts_valued(np.where(held >= 0, 100 + held, 0)), jnp.asarray(slot_of_expert),
                      jnp.asarray(held))


@pytest.mark.quick
def test_a_planned_copy_of_an_expert_already_cached_is_skipped():
    """A plan a step old may name an expert that the step in between admitted: it is not copied a second time (two
    slots would claim it), and the plan's other copies go ahead."""
    slots = one_layer_slots([3, -1, 6])
    host = experts_valued(100 + np.arange(8))
    after, evicted, copied = copy_wanted(slots, host, jnp.asarray([3, 5], jnp.int32), jnp.asarray([1, 2], jnp.int32))
    assert int(copied) == 1 and int(evicted) == 1  # 5 into slot 2, over 6
    np.testing.assert_array_equal(after.expert_in_slot, [3, -1, 5])
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(after.slot_of_expert) >= 0), [3, 5])
    np.testing.assert_array_equal(np.asarray(after.buffers.w_down).ravel(), [103, 0, 105])


@pytest.mark.quick
def test_the_manager_counts_its_last_plan_as_made_until_a_step_shows_it():
    """Host miss mode plans one admission per layer and step. Read back from a step dispatched before that plan was
    handed out, the tables do not show it yet: the manager takes it as made (the next step makes it) and plans the
    next expert instead of the same one again; read back from the step that made it, the tables are taken as they
    are."""
    manager = SlotManager("lru", num_experts=8, caches=(2,), expert_bytes=1, plan_width=1)
    counts = np.zeros((1, 4), np.int64)
    empty = np.full((1, 8), -1, np.int32)
    manager.record(np.array([[[0, 1]]]), empty, counts)
    _, experts, slots = manager.next_step()
    first = (int(experts[0, 0]), int(slots[0, 0]))
    assert first[1] >= 0 and first[0] in (0, 1)
    # The next step was dispatched before that plan: it missed 0 and 1 again, and its tables show nothing admitted.
    manager.record(np.array([[[0, 1]]]), empty, counts)
    assert manager.slot_of_expert[0, first[0]] == first[1]
    _, experts, slots = manager.next_step()
    second = (int(experts[0, 0]), int(slots[0, 0]))
    assert second[0] == 1 - first[0] and second[1] not in (-1, first[1])
    # The step after made the first plan, and the second is in flight.
    made = empty.copy()
    made[0, first[0]] = first[1]
    manager.record(np.array([[[0, 1]]]), made, counts)
    both = made.copy()
    both[0, second[0]] = second[1]
    np.testing.assert_array_equal(manager.slot_of_expert, both)
    _, _, slots = manager.next_step()
    assert (slots == -1).all()  # nothing left to admit
    # A step that shows every plan made: its tables as they are.
    manager.record(np.array([[[0, 1]]]), both, counts)
    np.testing.assert_array_equal(manager.slot_of_expert, both)


def assert_slots_hold_their_experts(model):
    """Every offloaded layer's tables are each other's inverse, and each filled slot holds its expert's weights."""
    state = model.engine.state
    for i, host in enumerate(model.engine.host_experts):
        slot_of_expert, expert_in_slot = np.asarray(state.slot_of_expert[i]), np.asarray(state.expert_in_slot[i])
        for slot, expert in enumerate(expert_in_slot):
            if expert >= 0:
                assert slot_of_expert[expert] == slot
                np.testing.assert_array_equal(np.asarray(state.buffers[i].w_down[slot]),
                                              np.asarray(host.stacked().w_down[expert]))
        assert ((slot_of_expert >= 0).sum() == (expert_in_slot >= 0).sum())


@pytest.mark.parametrize("options", [dict(policy="lru"), dict(policy="lfu", prefetch=1),
                                     dict(policy="lru", miss_mode="host")])
def test_running_ahead_gives_the_tokens_of_waiting(options, hf_checkpoints):
    """The same tokens with each step dispatched ahead and with each read back first, and tables that match the
    slots after either (fetch mode, router prefetch, host mode: every way the step admits an expert)."""
    model = jmoe.load(hf_checkpoints["olmoe_e8k4_clip"][0], cache=2, progress=False, **options)
    tokens = {}
    for run_ahead in (True, False):
        model.set_policy(options["policy"])
        tokens[run_ahead] = model.generate_detailed(PROMPTS, 12, SamplingParams(), run_ahead=run_ahead).tokens
        assert_slots_hold_their_experts(model)
        stats = model.stats()
        assert sum(s["hits"] + s["misses"] for s in stats) > 0 and sum(s["hits"] for s in stats) > 0
    assert tokens[True] == tokens[False]


def test_host_mode_running_ahead_admits_a_step_later(hf_checkpoints):
    """Every token forced to experts 0-3, cache 2, host miss mode: read back each step first, decode steps hit 1, 2,
    2, 2, 2 (tests/test_offload.py); dispatched ahead, the first decode step runs before the prompt's plan exists
    and the rest follow a step later: 0, 1, 2, 2, 2 (planning the prompt's admission again would give 0, 1, 1, 2, 2)."""
    model = jmoe.load(hf_checkpoints["olmoe_e8k4_clip"][0], cache=2, policy="lru", miss_mode="host", progress=False)
    forced = first_four_experts(model.config.num_moe_layers)
    out = model.generate_detailed([PROMPTS[1]], 6, SamplingParams(), routing_override=forced).tokens[0]
    assert len(out) == 6
    for layer in model.stats():
        assert layer["hits"] == 0 + 1 + 2 + 2 + 2
    assert_slots_hold_their_experts(model)


@pytest.mark.quick
def test_the_disk_tier_and_history_prefetch_wait_for_each_step(hf_checkpoints):
    """A disk tier's rows are written between steps from the step's reads, and history prefetch scores from every
    token before the step: with either, each step is read back before the next is dispatched, in the engine and in
    the plan's estimate alike (jmoe.offload.engine.steps_run_ahead)."""
    from test_plan_estimate import host_budget_for
    from test_plan_gpu_compile import routing_trace

    directory = hf_checkpoints["olmoe_e8k4_clip"][0]
    trace = routing_trace(jmoe.load_config(directory))
    plain, history, tiered = (jmoe.plan(directory, cache=2, **options) for options in (
        {}, {"prefetch_trace": trace}, {"host_budget_gb": host_budget_for(directory, 2, 4)}))
    assert [steps_run_ahead(p.placement, p.options) for p in (plain, history, tiered)] == [True, False, False]
    assert jmoe.load(directory, cache=2, prefetch_trace=trace, progress=False).engine.runs_ahead is False
