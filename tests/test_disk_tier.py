"""The disk tier (jmoe.load(..., host_budget_gb=X), jmoe.offload.host_tier): experts beyond the host budget are
read from the checkpoint files when a step needs them, and results never change."""

import concurrent.futures
import functools
import threading

import jax
import numpy as np
import pytest

import jmoe
import jmoe.api
from hf_models import VOCAB, write_checkpoint
from jmoe.decode import chain
from jmoe.checkpoint.convert import convert_checkpoint
from jmoe.checkpoint.expert_reader import THREAD_PREFIX
from jmoe.checkpoint.read_buffers import PIECE_THREAD_PREFIX
from jmoe.decode.sampling import SamplingParams
from jmoe.errors import InputError
from jmoe.offload.host_tier import STAGED_PER_LAYER, HostTier, host_budget_gb_holding
from jmoe.plan import resources
from jmoe.traces.forced_routing import TraceRouting
from jmoe.traces.load import load_trace, split_trace

FAMILIES = ["mixtral_e4k2_gqa2", "olmoe_e8k4_clip", "deepseek_v3_qlora_groups", "gpt_oss_e8k3_mqa_tied_yarn"]
PROMPTS = [list(np.random.RandomState(1).randint(0, VOCAB, 11)), list(np.random.RandomState(2).randint(0, VOCAB, 4))]
LOGIT_IDS = np.random.RandomState(3).randint(0, VOCAB, (2, 9))


@functools.cache
def layer_expert_bytes(directory, expert_dtype=None) -> tuple[int, int]:
    """Bytes of one expert of every MoE layer together (the placement's, all layers offloaded), and the layers."""
    probe = jmoe.load(directory, cache=0, progress=False, expert_dtype=expert_dtype).placement_plan
    return probe.layer_expert_bytes, len(probe.offloaded_layers)


def budget_for(directory, rows: int, expert_dtype=None, read_ahead: int = 0) -> float:
    """The host budget (GB) that holds `rows` experts of every offloaded layer, the staged ones and `read_ahead`."""
    layer_bytes, layers = layer_expert_bytes(directory, expert_dtype)
    return host_budget_gb_holding(rows, layer_bytes, read_ahead * layer_bytes // layers)


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith((THREAD_PREFIX, PIECE_THREAD_PREFIX))]


def results(model):
    return np.asarray(model.logits(LOGIT_IDS)), model.generate(PROMPTS, max_new_tokens=10)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_cache_and_host_budget_matches_resident(name, hf_checkpoints):
    directory = hf_checkpoints[name][0]
    resident = jmoe.load(directory, progress=False)
    ref_logits, ref_tokens = results(resident)
    e, k = resident.config.num_experts, resident.config.num_experts_per_tok
    # Fewer rows than a token's experts, and the most a disk tier has (all but the staged one and one more); the
    # first family also k rows next to one slot, and scratch slots for one row's misses (both prompts' misses do
    # not fit them: the rest are computed on the host, from host rows or disk).
    settings = [(0, 1, 8), (k, e - 1 - STAGED_PER_LAYER, 8)] + ([(1, k, 8), (0, 1, 1)] if name == FAMILIES[0] else [])
    for cache, rows, scratch_rows in settings:
        with jmoe.load(directory, cache=cache, host_budget_gb=budget_for(directory, rows), scratch_rows=scratch_rows,
                       progress=False) as model:
            assert model.placement_plan.host_rows == rows
            assert model.placement_plan.scratch == jax.tree.leaves(model.engine.state.scratch)[0].shape[0] == min(
                e, scratch_rows * k)
            logits, tokens = results(model)
            np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0, err_msg=f"cache={cache} rows={rows}")
            assert tokens == ref_tokens, f"cache={cache} rows={rows}"
            stats = model.stats()
            assert all(layer["host_rows"] == rows for layer in stats)
            assert sum(layer["disk_reads"] for layer in stats) > 0  # the disk was read: rows < E
            assert all(layer["disk_bytes"] == layer["disk_reads"] * model.placement_plan.expert_bytes
                       for layer in stats)
            model.set_policy("lru")  # starts over: rows refilled, counts at zero, results the same
            assert all(layer["disk_reads"] == 0 and layer["hits"] == 0 for layer in model.stats())
            assert model.generate(PROMPTS, max_new_tokens=10) == ref_tokens
        assert not reader_threads()


@pytest.mark.quick
def test_tiered_experts_are_not_loaded_and_the_placement_counts_the_rows(hf_checkpoints):
    directory = hf_checkpoints["olmoe_e8k4_clip"][0]
    whole = jmoe.load(directory, cache=2, progress=False)
    with jmoe.load(directory, cache=2, host_budget_gb=budget_for(directory, 3), progress=False) as model:
        for block in model.module().moe_blocks():  # the model holds none of them: the tier's rows do
            assert block.experts.w_gate_up[...].shape[0] == 0
        rows = [leaf for tier in model.engine.state.host_tier for leaf in jax.tree.leaves(tier)]
        assert all(leaf.shape[0] == 3 and leaf.sharding.memory_kind == "pinned_host" for leaf in rows)
        experts_host = whole.placement_plan.totals()["host_bytes"]
        assert model.placement_plan.totals()["host_bytes"] == experts_host * (3 + STAGED_PER_LAYER) // 8
        assert any("host_budget_gb" in note for note in model.placement_plan.notes)
        # 3 rows next to 2 slots: the rows also hold the slots' experts, so the plan warns
        assert any(note.startswith("warning: 3 host rows per layer is under twice the device cache (2)")
                   for note in model.placement_plan.notes)
    with jmoe.load(directory, cache=2, host_budget_gb=budget_for(directory, 4), progress=False) as enough:
        assert not any(note.startswith("warning") for note in enough.placement_plan.notes)


def test_an_orbax_checkpoint_and_quantized_experts_read_from_disk_buffered_or_direct_match(hf_checkpoints, tmp_path,
                                                                                          monkeypatch):
    directory = hf_checkpoints["mixtral_e4k2_gqa2"][0]
    orbax = convert_checkpoint(directory, tmp_path / "orbax", progress=False)
    planned = []  # what direct_reads=None asks the page cache's room for: the host tier's rows come first

    def no_room(planned_bytes):  # so direct_reads=None reads direct
        planned.append(planned_bytes)
        return 0, "a test's"

    monkeypatch.setattr(resources, "page_cache_room", no_room)
    for path, kwargs, direct in ((orbax, {}, None), (orbax, {}, False), (directory, {"expert_dtype": "int8"}, True)):
        ref_logits, ref_tokens = results(jmoe.load(path, progress=False, **kwargs))
        budget = budget_for(path, 1, kwargs.get("expert_dtype"))
        with jmoe.load(path, cache=1, host_budget_gb=budget, progress=False, direct_reads=direct, **kwargs) as model:
            assert model.engine.tier.reader.direct == (direct is not False)
            assert planned == ([int(budget * 1e9)] if direct is None else [])
            planned.clear()
            logits, tokens = results(model)
            np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0, err_msg=str(kwargs))
            assert tokens == ref_tokens
            assert sum(layer["disk_reads"] for layer in model.stats()) > 0
    assert not reader_threads()


@pytest.fixture(scope="module")
def gptoss_routed(tmp_path_factory):
    """A small model shaped for GPT-OSS-20B's routing (its first 4 MoE layers, 32 experts, top-4): (its directory, the
    trace's tuning split, its report split), both cut to those layers."""
    layers = 4
    directory = tmp_path_factory.mktemp("gptoss_routed") / "m"
    write_checkpoint(directory, "mixtral", seed=3, num_local_experts=32, num_experts_per_tok=4,
                     num_hidden_layers=layers, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)
    split = split_trace(load_trace("gptoss"), None)
    return directory, split["tune_ids"][:, :layers], split["eval_ids"][:, :layers]


def test_read_ahead_starts_the_predicted_reads_early_and_changes_no_result(gptoss_routed):
    """GPT-OSS-20B's routing forced on a small model: the history predictor fitted on the trace's tuning split reads
    ahead for 48 tokens of its report split."""
    directory, tuning, report = gptoss_routed
    rows = report[:48]
    counts = {}
    for read_ahead in (0, 6):
        budget = budget_for(directory, 8, read_ahead=read_ahead)
        options = {"prefetch_trace": tuning, "read_ahead": read_ahead} if read_ahead else {}
        with jmoe.load(directory, cache=4, host_budget_gb=budget, progress=False, **options) as model:
            routing = TraceRouting(rows, prompt_len=1, config=model.config)
            model.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing)
            stats = model.stats()
            counts[read_ahead] = {key: sum(layer[key] for layer in stats)
                                  for key in ("disk_reads", "read_ahead_reads", "read_ahead_used", "disk_bytes")}
        assert not reader_threads()
    plain, ahead = counts[0], counts[6]
    assert plain["read_ahead_reads"] == plain["read_ahead_used"] == 0
    assert 0 < ahead["read_ahead_used"] <= min(ahead["read_ahead_reads"], ahead["disk_reads"])
    # Reads a step waited for from their start (not read ahead): at least half fewer (the in-step guesses of the
    # next layer's experts in no row found 278 of the 413 when this was written).
    assert ahead["disk_reads"] - ahead["read_ahead_used"] <= 0.5 * plain["disk_reads"], counts
    expert_bytes = model.placement_plan.expert_bytes
    assert ahead["disk_bytes"] == (ahead["disk_reads"] - ahead["read_ahead_used"] + ahead["read_ahead_reads"]) \
        * expert_bytes
    prompts = [list(np.random.RandomState(i).randint(0, VOCAB, 6)) for i in range(2)]
    expected = jmoe.load(directory, progress=False).generate(prompts, max_new_tokens=8)
    with jmoe.load(directory, cache=2, host_budget_gb=budget_for(directory, 5, read_ahead=4), prefetch_trace=tuning,
                   read_ahead=4, progress=False) as model:
        assert model.generate(prompts, max_new_tokens=8) == expected
        assert sum(layer["read_ahead_reads"] for layer in model.stats()) > 0


def test_a_chained_step_reads_ahead_what_the_one_program_step_reads_ahead(gptoss_routed, monkeypatch):
    """Blocks of one layer (jmoe.decode.chain): each layer's read-ahead for the next, in the next block, reads that
    layer's host rows' table, so the reads, reads ahead and reads used are the one program's."""
    directory, tuning, report = gptoss_routed
    rows = report[:24]
    options = dict(cache=4, host_budget_gb=budget_for(directory, 8, read_ahead=6), prefetch_trace=tuning,
                   read_ahead=6, progress=False)
    # Which reads ahead have finished when the step ends is the disk threads' timing (the tier admits those): every
    # one settled first, so that both runs admit the same ones (under a loaded suite they had differed by one).
    admissions = HostTier.admissions

    def settled(tier, *args):
        with tier._lock:
            ahead = [future for future, _ in tier._ahead.values()]
        concurrent.futures.wait(ahead)
        return admissions(tier, *args)

    monkeypatch.setattr(HostTier, "admissions", settled)
    stats = []
    for chained in (False, True):
        if chained:
            monkeypatch.setattr(chain, "LAYERS_PER_PROGRAM", 1)
            monkeypatch.setattr(jmoe.api, "chains", lambda config, engine: True)
        with jmoe.load(directory, **options) as model:
            assert (model.step_chain is not None) == chained
            routing = TraceRouting(rows, prompt_len=1, config=model.config)
            model.generate_detailed([[1]], routing.max_new_tokens, SamplingParams(), routing_override=routing)
            stats.append(model.stats())
    assert stats[0] == stats[1]
    assert sum(layer["read_ahead_used"] for layer in stats[1]) > 0
    assert not reader_threads()


@pytest.mark.quick
def test_budgets_and_options_the_tier_does_not_take_are_clear_errors(hf_checkpoints):
    directory = hf_checkpoints["mixtral_e4k2_gqa2"][0]
    one_row = budget_for(directory, 1)
    with pytest.raises(InputError, match=r"host_budget_gb=.* holds \d experts .* one host row and 1 staged .* give "
                                         r"at least"):
        jmoe.load(directory, cache=1, host_budget_gb=one_row / 2, progress=False)
    for option in ({"miss_mode": "host"}, {"prefetch": 1}, {"devices": 2}):
        with pytest.raises(InputError, match="host_budget_gb .* does not work with"):
            jmoe.load(directory, cache=1, host_budget_gb=one_row, progress=False, **option)
    with pytest.raises(InputError, match="host_budget_gb"):
        jmoe.load(directory, cache=1, host_budget_gb=-1.0, progress=False)
    with pytest.raises(InputError, match=r"scratch_rows .*, found 0"):
        jmoe.load(directory, cache=1, host_budget_gb=one_row, scratch_rows=0, progress=False)
    trace = np.zeros((8, 2, 2), np.int32)
    for options in ({"read_ahead": 2}, {"prefetch_trace": trace}):  # each needs the other with a host budget
        with pytest.raises(InputError, match="read_ahead .* and prefetch_trace .* go together"):
            jmoe.load(directory, cache=1, host_budget_gb=one_row, progress=False, **options)
    with pytest.raises(InputError, match="read_ahead=2 reads experts ahead from disk: it needs host_budget_gb"):
        jmoe.load(directory, cache=1, read_ahead=2, prefetch_trace=trace, progress=False)
    with pytest.raises(InputError, match="direct_reads=True decides how the disk tier reads experts: it needs "
                                         "host_budget_gb"):
        jmoe.load(directory, cache=1, direct_reads=True, progress=False)
    with pytest.raises(InputError, match=r"direct_reads must be True, False or None .*found 'yes'"):
        jmoe.load(directory, cache=1, host_budget_gb=one_row, direct_reads="yes", progress=False)
    # A budget that holds every expert: no disk tier, no reader.
    model = jmoe.load(directory, cache=1, host_budget_gb=1000.0, progress=False)
    assert model.placement_plan.host_rows == 0 and model.engine.tier is None and not reader_threads()


@pytest.mark.quick
def test_the_command_line_takes_a_host_budget_and_reports_disk_reads(hf_checkpoints, tmp_path, capsys):
    import shutil

    from hf_models import write_word_tokenizer
    from jmoe.generate import main

    directory = tmp_path / "m"
    shutil.copytree(hf_checkpoints["mixtral_e4k2_gqa2"][0], directory)
    write_word_tokenizer(directory)
    assert main(["--model", str(directory), "--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--cache", "1",
                 "--host-budget-gb", str(budget_for(directory, 1)), "--scratch-rows", "1", "--direct-reads", "on",
                 "--stats"]) == 0
    captured = capsys.readouterr()
    assert "host rows" in captured.out and "disk reads" in captured.out
    assert "disk tier: direct reads (direct_reads=True)" in captured.err
    assert "+ 2 scratch slots" in captured.err  # one row's top-2 misses (the placement summary)
    assert not reader_threads()
