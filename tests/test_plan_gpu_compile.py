"""jmoe.plan compiles jmoe's decode and prefill programs for an H100 on this CPU machine, in a child process,
for every supported family (one tiny checkpoint each, from tests/hf_models.py FAMILY_CASES)."""

import re

import numpy as np
import pytest

import jmoe
from hf_models import FAMILY_CASES
from jmoe.kernels.expert_copy import CHUNK
from jmoe.plan.hlo import (Collective, computations, copied_arrays, outputs_of_readers, side_stream_overlaps,
                           triton_grids)
from jmoe.plan.programs import PLUGIN_HINT, compile_programs, plugin_available

pytestmark = pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)

# The first case of every family, each with a different placement.
FAMILIES = list({model_type: name for name, (model_type, _) in reversed(FAMILY_CASES.items())}.values())[::-1]
PLACEMENTS = [dict(cache=1, offload_params=["attn"]), dict(cache=2, prefetch=1),
              dict(cpu_moe_layers=1, offload_group_size=2), dict()]
QUICK_CASE = "olmoe_e8k4_clip"  # the quick tier's H100 compile: the cheapest family


@pytest.mark.parametrize("case", [pytest.param(case, marks=[pytest.mark.quick] if case == QUICK_CASE else [])
                                  for case in FAMILIES])
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
        assert program.cost_analysis["flops"] > 0 and program.cost_analysis["bytes accessed"] > 0
    assert needs.program_bytes == max(p.device_bytes for p in plan.programs.values())
    assert plan.fits and plan.as_dict()["device_bytes_include_programs"]
    # the prefill of 64 tokens a row does more arithmetic than one decode token; the estimate reads both
    assert plan.programs["prefill"].cost_analysis["flops"] > plan.programs["decode"].cost_analysis["flops"]
    assert plan.estimate is not None
    if "cache" in options:  # uniform routing: a cache of c of E experts holds a needed one with chance c / E
        assert plan.estimate.hit_rate == pytest.approx(options["cache"] / plan.config.num_experts)


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


def test_batch_one_decode_writes_no_product_of_a_dense_weight(hf_checkpoints):
    """At batch 1, XLA:GPU turns each projection (a vector times a matrix of under 10M elements) into a multiply and
    a reduction. Dense weights stored [out, in] reduce along rows, and the multiply fuses into the reduction; stored
    [in, out] (before format version 2), XLA:GPU wrote products out whole, arrays of the weights' shapes, and read
    them back (here one, which failed this test; at a Mixtral's widths every projection's,
    bench/results/dense_layout_h100.md). The rewrite multiplies in the dot's result type: a bfloat16 model's products
    are float32 (jmoe.model.layers.project asks for it), exact, not rounded to bfloat16 before the sum."""
    plan, decode = decode_for_h100(hf_checkpoints["qwen2_moe_shared_dense"][0], "auto", context=64,
                                   dtype="bfloat16")
    assert decode.error is None, decode.error
    dense = {tuple(a.shape) for key, a in plan.headers.abstract.items()
             if len(a.shape) == 2 and min(a.shape) > 1 and "experts" not in key and key[0] != "embed"}
    assert len(dense) >= 4  # attention's and the dense MLP's
    for shape in dense:
        assert outputs_of_readers(decode.hlo_text, shape), shape  # each weight is read
        assert {shape, shape[::-1]}.isdisjoint(outputs_of_readers(decode.hlo_text, shape)), shape
    products = [found.group(1) for body in computations(decode.hlo_text).values()
                for found in re.finditer(r"= (\w+)\[([\d,]+)\]\S* multiply\(", body)
                if tuple(int(n) for n in found.group(2).split(",")) in dense]
    assert products and set(products) == {"f32"}


def host_array_readers(hlo_text: str) -> list[str]:
    """What reads each pinned-host (S(5)) array of the program, other than a bitcast of it (a reshape that moves
    nothing): the Pallas kernel's name for a Triton kernel (e.g. "copy_experts"), else the instruction."""
    host = set(re.findall(r"%(\S+) = [^=\n]*:S\(5\)\}[^=\n]* (?:parameter|bitcast)\(", hlo_text))
    readers = []
    for name, op, operands, rest in re.findall(r"%(\S+) = [^=\n]*? ([a-z-]+)\(([^)]*)\)(.*)", hlo_text):
        if name in host or op in ("tuple", "get-tuple-element", "while") or not host & set(re.findall(r"%([^,\s]+)",
                                                                                                 operands)):
            continue
        kernel = re.search(r'op_name="[^"]*/(\w+)/pallas_call"', rest)
        readers.append(kernel.group(1) if op == "custom-call" and kernel else op)
    return readers


def test_h100_prefill_streams_each_missing_expert_once_per_chunk(hf_checkpoints):
    """Issue #57: a prefill chunk of an offloaded layer copies each expert it needs and no slot holds from host memory
    once, whatever the chunk's length. Compiled for an H100 (cache 2 of 8, 4 scratch slots: each layer streams its
    experts in two groups of 4, jmoe.offload.slots.stream_and_compute): host memory is read by nothing but one
    expert-copy kernel per group and layer (jmoe.kernels.expert_copy), whose 4 entries are the group's experts (the
    missing experts ranked in it, -1 past the last: those move nothing) and whose programs each move one chunk of one
    expert's gate_up or down, so a program copies the missing experts once: at most the 6 of 8 no slot holds,
    whatever the chunk's length (nothing in the kernel is per token), with no loop."""
    tokens = 64
    plan = jmoe.plan(hf_checkpoints[QUICK_CASE][0], target="h100", compile=False, cache=2, scratch_rows=1,
                     backend="xla", context=tokens)
    cfg, placement = plan.config, plan.placement
    assert placement.scratch == 4 and placement.caches == (2, 2)
    (prefill,) = compile_programs(cfg, plan.headers.dtype, plan.options, "xla", 1, tokens, plan.target.config_text,
                                  programs=("prefill",)).values()
    assert prefill.error is None, prefill.error
    groups = -(-cfg.num_experts // placement.scratch)
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    chunks = -(-d * 2 * f // CHUNK) + -(-f * d // CHUNK)
    copies = [(chunks, placement.scratch, 1)] * len(placement.offloaded_layers) * groups
    assert triton_grids(prefill.hlo_text, "copy_experts") == copies
    assert prefill.control_flow.data_dependent_loops == 0 and prefill.control_flow.conditionals == 0
    assert host_array_readers(prefill.hlo_text) == ["copy_experts"] * len(copies)  # no other host read


def routing_trace(cfg, tokens: int = 64) -> np.ndarray:
    """int [tokens, MoE layers, k]: random distinct experts per step, a trace to fit the history predictor on."""
    rng = np.random.default_rng(0)
    return np.array([[rng.choice(cfg.num_experts, cfg.num_experts_per_tok, replace=False)
                      for _ in range(cfg.num_moe_layers)] for _ in range(tokens)])


def decode_for_h100(path, backend: str, **options):
    """(the plan, its decode program compiled for an H100): the prefill program, which these tests do not read, is
    not compiled."""
    plan = jmoe.plan(path, target="h100", compile=False, backend=backend, **options)
    programs = compile_programs(plan.config, plan.headers.dtype, plan.options, backend, plan.rows, plan.context,
                                plan.target.config_text, programs=("decode",))
    return plan, programs["decode"]


@pytest.mark.parametrize("prefetch,side_stream", [("router", False), ("history", True)])
def test_prefetching_decode_copies_what_it_keeps_without_conditionals(prefetch, side_stream, hf_checkpoints):
    """Cache 4 of 8 experts, prefetch=2 or prefetch_trace, compiled for an H100: no conditional and no loop. Every
    copy into slots is an expert-copy kernel (jmoe.kernels.expert_copy) whose unwanted entries move nothing: per
    offloaded layer the demand copies (batch x top-k = 2 entries, into the cache slots that admit them: 4 slots,
    every one offered, so no miss goes to scratch, prefetched slots offered last) and the prefetch, router prefetch's
    2 picks into every offloaded layer after the first, history prefetch's budget (4) into every one. Nothing
    slices host memory outside those kernels (issue 33, #54 item 1). With side_stream_copies (#54 item 4) each
    prefetch copy is an asynchronous call on a second stream; the demand copies stay on the compute stream. Which
    kernels run beside a prefetch is XLA's schedule: none here since the step lost its scratch path (the scratch
    kernels were all that ran beside them), none in gpu_decode_bound's Mixtral shape before either; the step-start
    copies of miss mode "direct" have the attention beside them (test_gpu_step)."""
    path = hf_checkpoints["qwen3_moe_headdim_tied"][0]
    cfg = jmoe.load_config(path)
    options = dict(prefetch=2) if prefetch == "router" else dict(prefetch_trace=routing_trace(cfg))
    options["side_stream_copies"] = side_stream
    # backend "xla": no expert kernels to compile; the copies are the same for every backend. With side streams the
    # GPU's own ("auto", Triton): XLA's scheduler ran the copies beside nothing between the xla backend's fusions.
    plan, decode = decode_for_h100(path, "auto" if side_stream else "xla", context=32, cache=4, **options)
    assert decode.error is None, decode.error
    offloaded = len(plan.placement.offloaded_layers)
    flow = decode.control_flow
    assert flow.conditionals == 0 and flow.host_loops == 0 and flow.data_dependent_loops == 0
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    chunks = -(-d * 2 * f // CHUNK) + -(-f * d // CHUNK)
    ahead = [2] * (offloaded - 1) if prefetch == "router" else [4] * offloaded
    expected = [(chunks, entries, 1) for entries in [2] * offloaded + ahead]
    assert sorted(triton_grids(decode.hlo_text, "copy_experts")) == sorted(expected)
    assert host_array_readers(decode.hlo_text) == ["copy_experts"] * len(expected)
    overlaps = side_stream_overlaps(decode.hlo_text)
    assert len(overlaps) == (len(ahead) if side_stream else 0), overlaps
    # The kernels write the donated cache slots in place: no slot buffer is copied whole.
    slot_arrays = {(slots, d, 2 * f) for slots in (4, plan.placement.scratch)} | {
        (slots, f, d) for slots in (4, plan.placement.scratch)}
    assert not slot_arrays & set(copied_arrays(decode.hlo_text))


@pytest.mark.parametrize("case,options", [("mixtral_e4k2_gqa2", dict(cache=1, devices=2, prefetch=1,
                                                                            side_stream_copies=True,
                                                                            extrapolate_layers=True)),
                                          ("deepseek_v3_qlora_groups", dict(cache=1, devices=4, expert_dtype="int4",
                                                                               expert_group_size=16))])
def test_expert_parallel_programs_carry_only_activations_between_devices(case, options, hf_checkpoints):
    """Compiled for N H100s of one host with the experts split over them: one all-reduce per MoE layer, of the
    layer's float32 output for the step's tokens, and nothing else crosses between the devices (no expert
    weight, no gather); each device's program holds its own share of the pinned experts, and with router
    prefetch writes its slots in place (XLA:CPU copies a device's next-layer cache buffer there; the GPU does
    not), with side_stream_copies in an asynchronous call on a second stream, inside the device's program."""
    path = hf_checkpoints[case][0]
    cfg = jmoe.load_config(path)
    devices = options["devices"]
    plan = jmoe.plan(path, target="h100", context=32, batch=2, backend="xla", **options)
    alone = {key: value for key, value in options.items() if key not in ("devices", "extrapolate_layers")}
    one = jmoe.plan(path, target="h100", context=32, batch=2, backend="xla", compile=False, **alone)
    for name, tokens in (("decode", 2), ("prefill", 2 * 32)):
        program = plan.programs[name]
        assert program.error is None, program.error
        activations = Collective("all-reduce", (f"f32[{tokens},{cfg.hidden_size}]",), tokens * cfg.hidden_size * 4)
        assert program.collectives == {activations: cfg.num_moe_layers}
        assert program.memory_analysis["host_argument_size_in_bytes"] * devices == plan.needs.host_bytes
    assert plan.needs.host_bytes == one.needs.host_bytes  # the host pins every device's share: the whole model's

    def squeezed(dims):
        return tuple(n for n in dims if n != 1)

    d, f, slots = cfg.hidden_size, cfg.expert_intermediate_size, (options["cache"], plan.placement.scratch)
    slot_arrays = {squeezed((n, d, 2 * f)) for n in slots} | {squeezed((n, f, d)) for n in slots}
    if "expert_dtype" not in options:  # quantized slots hold codes; their dequantized copies have these shapes
        assert not slot_arrays & {squeezed(dims) for dims in copied_arrays(plan.programs["decode"].hlo_text)}
    side_calls = len(side_stream_overlaps(plan.programs["decode"].hlo_text))
    assert side_calls == (cfg.num_moe_layers - 1 if options.get("side_stream_copies") else 0)  # prefetch's copies
    assert plan.as_dict()["programs"]["decode"]["collectives"] == [
        {"op": "all-reduce", "shapes": [f"f32[2,{cfg.hidden_size}]"], "bytes": 8 * cfg.hidden_size,
         "count": cfg.num_moe_layers}]
    assert f"decode program: {cfg.num_moe_layers} x all-reduce of f32[2,{cfg.hidden_size}]" in plan.report()
    assert plan.fits and plan.estimate is not None
    # two layers are compiled whole whatever is asked, and the plan says so
    whole = any(note.startswith("extrapolate_layers: the programs were compiled whole") for note in plan.notes)
    assert whole == ("extrapolate_layers" in options)


def test_host_mode_decode_loops_only_on_the_host(tmp_path):
    """With one offloaded layer its host computation has one caller, which jax 0.10 compiles for a GPU (several
    abort it, above): every data-dependent loop of the decode step runs on the host (XLA:GPU's host execution
    thread), none on the device, where each iteration would read its condition back (#54 item 1); the planned
    admission is a Triton copy, not a loop."""
    from bench.plan import write_header_only_checkpoint
    from hf_models import hf_config

    model_type, overrides = FAMILY_CASES[QUICK_CASE]
    config = hf_config(model_type, **{**overrides, "num_hidden_layers": 1}).to_dict()
    plan = jmoe.plan(write_header_only_checkpoint(tmp_path / "one-layer", config), target="h100", context=32,
                     cache=1, miss_mode="host")
    flow = plan.programs["decode"].control_flow
    assert plan.programs["decode"].error is None
    assert flow.host_loops >= 1 and flow.data_dependent_loops == 0 and flow.conditionals == 0
    assert flow.triton_kernels_reading_host >= 1  # the planned admission's copy
