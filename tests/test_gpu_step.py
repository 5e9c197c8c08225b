"""The decode step shaped for a GPU: what its program does when compiled for an H100 (no conditionals, no loop
with an unknown trip count, experts copied into slots by Triton kernels, Triton expert kernels), and the
engine behaviours behind it (large batches use the cache, float32 partial sums, one set of slot buffers)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from hf_models import VOCAB, write_checkpoint
from jmoe.kernels import ExpertKernel, ExpertWeights
from jmoe.offload.slots import (LayerSlots, Scratch, admitted_tables, empty_slots, fetch_and_compute, needed_experts,
                               rows_as_slots, rows_marked, slot_ids_of,
                               stream_and_compute)
from jmoe.kernels.expert_copy import CHUNK
from jmoe.plan.hlo import (computations, control_flow, copied_arrays, kernel_count, module_count, scatters,
                           side_stream_overlaps, triton_grids, triton_kernels_reading_host)
from jmoe.plan.programs import PLUGIN_HINT, plugin_available

needs_gpu_compile = pytest.mark.skipif(not plugin_available(), reason=PLUGIN_HINT)

@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """32 experts, top-2: 16 scratch slots, so a batch of 16 rows (32 choices) can miss more than they hold;
    d and f are multiples of 16, which the Triton kernels need."""
    directory = tmp_path_factory.mktemp("e32") / "qwen3_e32k2"
    write_checkpoint(directory, "qwen3_moe", seed=7, num_experts=32, num_experts_per_tok=2, moe_intermediate_size=16,
                     intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     norm_topk_prob=True)
    return directory


# (load options, batch): resident; offloaded with demand fetch, with router prefetch, at batch 1 and 8; the misses
# read in place (miss mode "direct"), also with its planned admissions on a second stream.
H100_DECODES = [
    (dict(backend="auto"), 8),
    (dict(cache=2, backend="pallas"), 1),
    (dict(cache=2, prefetch=1, backend="auto"), 8),
    (dict(cache=2, miss_mode="direct", backend="auto"), 1),
    (dict(cache=2, miss_mode="direct", side_stream_copies=True, backend="auto"), 1),
]


@needs_gpu_compile
@pytest.mark.parametrize("options,batch", H100_DECODES, ids=[f"{o}-b{b}" for o, b in H100_DECODES])
def test_h100_programs_have_no_host_syncs_and_run_triton_kernels(many_experts, options, batch):
    plan = jmoe.plan(many_experts, target="h100", context=64, batch=batch, **options)
    offloaded = len(plan.placement.offloaded_layers)
    decode = plan.programs["decode"]
    assert decode.error is None, decode.error
    flow = decode.control_flow
    cfg, placement = plan.config, plan.placement
    # No host round trip inside the step (#54 item 1): no conditional and no loop whose trip count is data. Experts
    # are copied into slots by one Triton kernel per copy site, over a static list of entries whose unwanted ones
    # move nothing: the demand copies of "fetch" (at most min(scratch, batch x top-k) experts, twice: into the
    # cache slots that admit them and into scratch for the rest; or, where the cache slots outnumber the experts a
    # step can route to, every miss admitted, batch x top-k experts once), the manager's planned admission of
    # "direct" (one), router prefetch into every offloaded layer after the first.
    assert flow.conditionals == 0 and flow.data_dependent_loops == 0 and flow.host_loops == 0
    # No loop at all (#54 item 5, launches): each iteration launches its body's kernels again; the grouped GEMM's tile
    # layout searched its groups' ends with a 5-iteration loop of 5 launches, per expert kernel call and layer.
    assert flow.loops_with_known_trip_count == 0
    assert flow.triton_kernels >= plan.config.num_moe_layers  # every MoE layer's experts run as Triton
    # A one-row step's expert FFNs are matrix-vector kernels reading the row and its choices' slots directly, with no
    # tile layout to build (#54 item 5: two kernels fewer a MoE layer); a batch's run as row tiles.
    ran, other = ("moe_gate_up_gemv", "moe_gate_up") if batch == 1 else ("moe_gate_up", "moe_gate_up_gemv")
    assert len(triton_grids(decode.hlo_text, ran)) >= cfg.num_moe_layers and not triton_grids(decode.hlo_text, other)
    # Each MoE layer chooses its experts in one kernel (#54 item 5): top-k, the chosen weights normalised and cast,
    # padding rows' ids -1; XLA made them a sort and two fusions, and a select of the ids in range before the experts.
    assert triton_grids(decode.hlo_text, "choose_experts") == [(batch, 1, 1)] * cfg.num_moe_layers
    assert ('/top_k" ' in decode.hlo_text) == ("prefetch" in options)  # router prefetch's guess still sorts
    # Each layer's attention is one kernel (#54 item 5): the new key and value written, the columns a row sees read
    # (a 64-column cache: one part); XLA made it five (two cache writes, scores, softmax, products with the values).
    assert triton_grids(decode.hlo_text, "attend_one_token") == [(batch, cfg.num_kv_heads, 1)] * cfg.num_layers
    direct = options.get("miss_mode") == "direct"
    # Miss mode "fetch"'s bookkeeping (which misses go where, the tables after) is one kernel an offloaded layer.
    assert triton_grids(decode.hlo_text, "fetch_plan") == ([] if direct else [(1, 1, 1)] * offloaded)
    routed = min(batch * cfg.num_experts_per_tok, cfg.num_experts)
    admitted = options.get("cache", cfg.num_experts) >= routed
    demand = [] if direct else ([routed] if admitted else [min(placement.scratch, routed)] * 2) * offloaded
    planned = [1] * offloaded if direct else []
    ahead = [options["prefetch"]] * (offloaded - 1) if "prefetch" in options else []
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    chunks = -(-d * 2 * f // CHUNK) + -(-f * d // CHUNK)  # gate_up's and down's
    copies = triton_grids(decode.hlo_text, "copy_experts")
    assert sorted(copies) == sorted((chunks, entries, 1) for entries in demand + planned + ahead)
    # Copies made ahead of need on a second stream with side_stream_copies (#54 item 4): one asynchronous call each.
    # Which compute-stream kernels run beside each is XLA's default scheduler's choice, which follows no rule this
    # program can set: here 26 and 9 kernels until the norms became kernels, none with them (each call's start placed
    # right before its done), 9 and 9 once the admitted tables were made once (slots.admitted_tables);
    # bench.gpu_decode_programs' Mixtral- and DeepSeek-shaped settings, which the GPU measures, have 14 a copy and 20
    # a copy (bench/results/gpu_decode_programs_h100.md).
    overlaps = side_stream_overlaps(decode.hlo_text)
    assert len(overlaps) == (len(planned + ahead) if options.get("side_stream_copies") else 0)
    # The copies read the pinned-host experts as they are (reshaped, no copy in between); so do, in "direct", each
    # offloaded layer's two expert kernels (gate-up, down); the other modes' expert kernels read device memory only.
    assert flow.triton_kernels_reading_host == len(copies) + (2 * offloaded if direct else 0)
    slot_arrays = {squeezed(shape) for slots in (*placement.caches, placement.scratch) if offloaded
                   for shape in ((slots, d, 2 * f), (slots, f, d))}
    assert not slot_arrays & {squeezed(dims) for dims in copied_arrays(decode.hlo_text)}  # updated in place
    # Admissions cost what they move (#54 item 2): an admitted expert is copied from the host straight into its
    # cache slot by the copy kernel; nothing scatters into a slot buffer on the device.
    assert not slot_arrays & {squeezed(operand) for operand, _ in scatters(decode.hlo_text)}
    # Each offloaded layer reads its row of the stacked tables (slot_of_expert, victim_order) at a position array of
    # its own, never at a constant: a constant row made every layer's kernels its own, and XLA:GPU compiles a kernel
    # once only for the places where it is identical.
    if offloaded > 1:
        reads = table_row_reads(decode.hlo_text, offloaded)
        assert reads["dynamic-slice"] >= offloaded and not reads["slice"], reads  # slot_of_expert's, at least
    prefill = plan.programs["prefill"]
    assert prefill.error is None, prefill.error
    # Streamed chunks compute masked, never branch, and are copied by the same kernel.
    assert prefill.control_flow.conditionals == 0 and prefill.control_flow.data_dependent_loops == 0


# An optimized module's text as XLA:GPU prints it: a side-stream call beside a host computation and a kernel, a second
# call beside nothing, then a command buffer; a computation before the entry has kernels of its own.
SIDE_STREAM_HLO = """HloModule m
%copy (a: f32[4]) -> f32[4] {
  ROOT %fusion.9 = f32[4]{0} fusion(%a), kind=kLoop, calls=%g
}
ENTRY %main (p: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %call-start = ((f32[4]), f32[4]) call-start(%p), to_apply=%copy, frontend_attributes={_xla_stream_annotation="1"}
  %host-start = ((f32[4]), f32[4]) async-start(%p), calls=%host, frontend_attributes={_xla_compute_type="host"}
  %fusion = f32[4]{0} fusion(%p), kind=kLoop, calls=%f
  %host-done = f32[4]{0} async-done(%host-start)
  %call-done = f32[4]{0} call-done(%call-start), frontend_attributes={_xla_stream_annotation="1"}
  %call-start.1 = ((f32[4]), f32[4]) call-start(%fusion), to_apply=%c, frontend_attributes={_xla_stream_annotation="1"}
  %call-done.1 = f32[4]{0} call-done(%call-start.1)
  %command_buffer = f32[4]{0} call(%call-done.1), to_apply=%cb
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(%command_buffer, %call-done)
}
"""


def test_side_stream_overlaps_counts_the_work_between_each_calls_start_and_done():
    assert side_stream_overlaps(SIDE_STREAM_HLO) == [2, 0]  # the host computation's start and the fusion; nothing
    assert side_stream_overlaps(SIDE_STREAM_HLO.replace("_xla_stream_annotation", "_xla_other")) == []


LOOP_HLO = """HloModule m
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%f, metadata={op_name="jit(step)/dot_general"}
  %fusion.2 = s32[] fusion(%b), kind=kLoop, calls=%g
  ROOT %tuple = (s32[], f32[4]) tuple(%fusion.2, %fusion.1)
}
%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %fusion.3 = pred[] fusion(%c), kind=kLoop, calls=%h
}
%copy (a: f32[4]) -> f32[4] {
  ROOT %custom-call.3 = f32[4]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
}
%f (x: f32[4]) -> f32[4] {
  ROOT %dot.9 = f32[4]{0} dot(%x, %x), lhs_contracting_dims={}
}
ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %fusion = f32[4]{0} fusion(%p), kind=kLoop, calls=%f
  %custom-call = (s32[], s32[], s32[], s32[], s32[], /*index=5*/s32[]) custom-call(%p), custom_call_target="x"
  %while = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %call-start = ((f32[4]), f32[4]) call-start(%fusion), to_apply=%copy, frontend_attributes={_xla_stream_annotation="1"}
  %call-done = f32[4]{0} call-done(%call-start)
  ROOT %sort = f32[4]{0} sort(%call-done), dimensions={0}, to_apply=%less
}
"""


def test_kernel_count_counts_launches_a_run():
    # The entry's fusion, custom call (its tuple type, past 5 elements, has /*index=5*/ in it) and sort, the async
    # call's kernel, the loop's body (2) and condition (1) five times; not the dot inside the fused computation %f.
    assert kernel_count(LOOP_HLO) == 3 + 1 + 5 * 3
    assert kernel_count(LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")) == 3 + 1 + 3
    # A chained step's text, its pieces' modules one after another (their computations' names alike): each counted.
    assert kernel_count("\n".join([LOOP_HLO] * 3)) == 3 * (3 + 1 + 5 * 3)


HOST_READING_MODULE = """HloModule piece_{i}
ENTRY %main (p: f32[4], q: f32[4]) -> f32[4] {{
  %p = f32[4]{{0:S({space})}} parameter(0)
  %q = f32[4]{{0}} parameter(1)
  ROOT %custom-call = f32[4]{{0}} custom-call(%p, %q), custom_call_target="__gpu$xla.gpu.triton"
}}
"""


def test_host_reads_are_counted_in_each_module_of_a_chained_program_s_text():
    # The second piece's %p lies in device memory: the first's pinned-host %p must not make its kernel count.
    pieces = [HOST_READING_MODULE.format(i=0, space=5), HOST_READING_MODULE.format(i=1, space=1)]
    assert triton_kernels_reading_host(pieces[0]) == 1 and triton_kernels_reading_host(pieces[1]) == 0
    assert triton_kernels_reading_host("".join(pieces)) == 1


def test_module_count_counts_the_modules_of_a_chained_program_s_text():
    assert module_count(LOOP_HLO) == 1 and module_count("\n".join([LOOP_HLO] * 3)) == 3  # as_text's pieces


@pytest.mark.cpu_hlo
def test_host_mode_decode_has_device_control_flow_only_on_the_host(hf_checkpoints):
    """Host miss mode cannot be compiled for a GPU target in jax 0.10 (see test_plan_gpu_compile); its
    CPU-compiled decode program shows the device-side control flow: no conditional, and every loop with an
    unknown trip count is inside a host computation but one per offloaded layer: the copies of the manager's
    planned admissions, only those that admit an expert (issue 33)."""
    model = jmoe.load(hf_checkpoints["olmoe_e8k4_clip"][0], cache=2, miss_mode="host", backend="gather",
                      progress=False)
    model.generate([[1, 2, 3]], max_new_tokens=3)
    (decode,) = [step["hlo"] for step in model.compiled_steps() if step["tokens"][1] == 1]
    flow = control_flow(decode)
    assert flow.conditionals == 0 and flow.data_dependent_loops == len(model.engine.layers)
    assert flow.host_loops >= model.config.num_moe_layers


SLOT_UPDATES = [dict(backend="auto"), dict(backend="gather"), dict(prefetch=1), dict(miss_mode="host", backend="gather")]


@pytest.mark.cpu_hlo
@pytest.mark.parametrize("options", SLOT_UPDATES, ids=[str(o) for o in SLOT_UPDATES])
def test_decode_updates_slot_buffers_in_place(many_experts, options):
    """The decode program copies missed experts into the cache and scratch slots and reads them, in place: it
    copies none of them whole, nor a slice of many slots (each such copy would move every slot of every offloaded
    layer each step)."""
    model = jmoe.load(many_experts, cache=2, progress=False, **options)
    model.generate([[1, 2, 3], [4, 5, 6]], max_new_tokens=3)
    (decode,) = [step["hlo"] for step in model.compiled_steps() if step["tokens"][1] == 1]
    state = model.engine.state
    slot_arrays = {squeezed(leaf.shape) for leaf in jax.tree.leaves((state.buffers, state.scratch))}
    assert slot_arrays and not slot_arrays & {squeezed(dims) for dims in copied_arrays(decode)}


def table_row_reads(hlo_text: str, rows: int) -> dict[str, int]:
    """How many times a computation reads one row of an int32 [rows, n] parameter, by a slice at a constant row and
    by a dynamic-slice."""
    reads = {"slice": 0, "dynamic-slice": 0}
    for body in computations(hlo_text).values():
        shapes = dict(re.findall(r"%([\w.-]+) = (s32\[\d+,\d+\])\{[^}]*\} parameter\(", body))
        for kind, operand in re.findall(r"= s32\[1,\d+\]\S* (slice|dynamic-slice)\(%([\w.-]+)", body):
            reads[kind] += shapes.get(operand, "").startswith(f"s32[{rows},")
    return reads


def squeezed(dims) -> tuple[int, ...]:
    """Dimensions without unit axes (a copied slice of k slots may keep a unit axis a slot buffer lacks)."""
    return tuple(n for n in dims if n != 1)


@pytest.mark.parametrize("miss_mode", ["fetch", "host"])
def test_decode_batches_larger_than_the_scratch_slots_use_the_cache(many_experts, miss_mode):
    prompts = [list(np.random.RandomState(i).randint(0, VOCAB, 5)) for i in range(16)]
    expected = jmoe.load(many_experts, progress=False).generate(prompts, max_new_tokens=6)
    model = jmoe.load(many_experts, cache=8, policy="lfru", miss_mode=miss_mode, progress=False)
    assert model.placement_plan.scratch == 16
    assert model.generate(prompts, max_new_tokens=6) == expected
    # The prompt step leaves the cache to decode, so every hit is a decode step's.
    assert all(layer["hits"] > 0 for layer in model.stats())


def test_bfloat16_results_do_not_depend_on_which_experts_are_cached():
    """Partial outputs (cache slots, scratch slots) are float32 and rounded once after their sum, so a
    bfloat16 layer gives the same bits whatever the cache holds."""
    rng = np.random.RandomState(0)
    e, d, f, t, k = 8, 64, 32, 4, 3
    host = ExpertWeights(jnp.asarray(rng.randn(e, d, 2 * f) * 0.3, jnp.bfloat16),
                         jnp.asarray(rng.randn(e, f, d) * 0.3, jnp.bfloat16))
    x = jnp.asarray(rng.randn(t, d), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), t), jnp.float32)
    kernel = ExpertKernel("gather", "swiglu")
    resident = kernel(x, ids, weights, host)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def layer_with_cached(cached: tuple, victims: tuple):
        slots = LayerSlots(jax.tree.map(lambda a: a[jnp.asarray(cached)], host),
                           jnp.full((e,), -1, jnp.int32).at[jnp.asarray(cached)].set(jnp.arange(len(cached))),
                           jnp.asarray(cached, jnp.int32))
        y, *_ = fetch_and_compute(slots, Scratch(empty_slots(host, e)), jnp.asarray(victims, jnp.int32), host, x, ids,
                                  weights, kernel=kernel)
        return y.astype(jnp.bfloat16)

    # Victims offered or not: misses computed from the cache slots that admit them, or from scratch.
    for victims in [(-1, -1, -1), (2, 0, 1)]:
        for cached in [(0, 1, 2), (int(ids[0, 0]), int(ids[1, 1]), int(ids[2, 2])), (5, 6, 7)]:
            np.testing.assert_array_equal(np.asarray(layer_with_cached(cached, victims), np.float32),
                                          np.asarray(resident, np.float32), err_msg=f"cached {cached}, {victims}")


@pytest.mark.quick
@pytest.mark.parametrize("chunk_size", [2, 3, 8])
def test_gpu_prefill_streaming_is_exact(chunk_size):
    """The GPU prefill path (CPU prefill reads experts in place instead): cached experts from their slots,
    the other needed ones streamed through chunk buffers, including chunks that hold fewer experts than they
    could and chunks past the last miss."""
    rng = np.random.RandomState(1)
    e, d, f, t, k = 8, 32, 16, 12, 2
    host = ExpertWeights(jnp.asarray(rng.randn(e, d, 2 * f), jnp.float32), jnp.asarray(rng.randn(e, f, d), jnp.float32))
    x = jnp.asarray(rng.randn(t, d), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(7, k, replace=False) for _ in range(t)]), jnp.int32)  # expert 7 unused
    ids = ids.at[3].set(-1)  # a padding token
    weights = jnp.asarray(rng.dirichlet(np.ones(k), t), jnp.float32)
    kernel = ExpertKernel("xla_tiled", "swiglu")
    cached = jnp.asarray([4, 1], jnp.int32)
    slots = LayerSlots(jax.tree.map(lambda a: a[cached], host),
                       jnp.full((e,), -1, jnp.int32).at[cached].set(jnp.arange(2)), cached)
    y = jax.jit(functools.partial(stream_and_compute, kernel=kernel, chunk_size=chunk_size))(slots, host, x, ids, weights)
    expected = ExpertKernel("reference", "swiglu")(x, ids, weights, host)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("chunk_size", [2, 3])
def test_gpu_prefill_over_the_disk_tier_streams_only_needed_rows(chunk_size):
    """The disk tier's prefill on the GPU path: the host rows taken as the layer's experts (rows_as_slots), the
    rows whose expert a slot holds read from the slot, the other needed rows streamed, the experts in no row
    left to the disk (here: computed apart and added). Equals every expert computed resident."""
    rng = np.random.RandomState(2)
    e, d, f, t, k = 8, 32, 16, 12, 2
    experts = ExpertWeights(jnp.asarray(rng.randn(e, d, 2 * f), jnp.float32),
                            jnp.asarray(rng.randn(e, f, d), jnp.float32))
    in_row = jnp.asarray([6, 1, 4, 3, 0], jnp.int32)  # row -> expert; experts 2, 5, 7 on disk only
    host_rows = jnp.full((e,), -1, jnp.int32).at[in_row].set(jnp.arange(5, dtype=jnp.int32))
    rows = jax.tree.map(lambda a: a[in_row], experts)
    cached = jnp.asarray([4, 6], jnp.int32)  # in rows 2 and 0 (inclusive)
    slots = LayerSlots(jax.tree.map(lambda a: a[cached], experts),
                       jnp.full((e,), -1, jnp.int32).at[cached].set(jnp.arange(2)), cached)
    x = jnp.asarray(rng.randn(t, d), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32).at[3].set(-1)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), t), jnp.float32)
    kernel = ExpertKernel("xla_tiled", "swiglu")
    row_slots = rows_as_slots(slots, host_rows, 5)
    np.testing.assert_array_equal(np.asarray(row_slots.slot_of_expert), [1, -1, 0, -1, -1])
    np.testing.assert_array_equal(np.asarray(row_slots.expert_in_slot), [2, 0])
    from_rows = jax.jit(functools.partial(stream_and_compute, kernel=kernel, chunk_size=chunk_size))(
        row_slots, rows, x, slot_ids_of(host_rows, ids), weights)
    on_disk = jnp.where(host_rows[jnp.maximum(ids, 0)] < 0, ids, -1)
    expected = ExpertKernel("reference", "swiglu")(x, ids, weights, experts)
    y = from_rows + ExpertKernel("reference", "swiglu")(x, on_disk, weights, experts)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=2e-5, atol=2e-5)


@pytest.mark.cpu_hlo
def test_cpu_prefill_reads_offloaded_experts_in_place(many_experts):
    """On CPU the prompt step reads every expert from the host arrays: its program copies no layer's expert
    arrays (XLA:CPU drops the device_put of a whole host array) and allocates no chunk buffers."""
    model = jmoe.load(many_experts, cache=2, progress=False)
    reference = jmoe.load(many_experts, progress=False)
    prompt = list(np.random.RandomState(3).randint(0, VOCAB, 24))
    assert model.generate(prompt, max_new_tokens=3) == reference.generate(prompt, max_new_tokens=3)
    (prefill,) = [step["hlo"] for step in model.compiled_steps() if step["tokens"][1] > 1]
    cfg, placement = model.config, model.placement_plan
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    layer_arrays = {(n, d, 2 * f) for n in (cfg.num_experts, placement.scratch)} | {
        (n, f, d) for n in (cfg.num_experts, placement.scratch)}
    assert not layer_arrays & {squeezed(dims) for dims in copied_arrays(prefill)}
    assert not any(f"f32[{placement.scratch},{d},{2 * f}]" in line for line in prefill.splitlines()
                   if "broadcast" in line)  # no zeroed chunk buffer


def test_set_policy_releases_the_old_slot_buffers_before_allocating(hf_checkpoints, monkeypatch):
    from jmoe.offload import engine as engine_module

    model = jmoe.load(hf_checkpoints["olmoe_e8k4_clip"][0], cache=3, progress=False)
    model.generate([[1, 2, 3]], max_new_tokens=2)
    slot_shape = model.engine.state.buffers[0].w_gate_up.shape
    live_at_allocation = []
    allocate = engine_module.empty_slots

    def counting_empty_slots(like, count):
        live_at_allocation.append(sum(a.shape == slot_shape for a in jax.live_arrays()))
        return allocate(like, count)

    monkeypatch.setattr(engine_module, "empty_slots", counting_empty_slots)
    model.set_policy("lru")
    assert live_at_allocation and live_at_allocation[0] == 0
    assert model.generate([[1, 2, 3]], max_new_tokens=2) == jmoe.load(
        hf_checkpoints["olmoe_e8k4_clip"][0], progress=False).generate([[1, 2, 3]], max_new_tokens=2)


@pytest.mark.quick
def test_table_updates_match_a_reference_without_scatters():
    """Admitting experts into cache slots and marking the needed experts are comparisons and selects (on a GPU a
    scatter is a kernel of its own; these fuse): the tables come out as a plain NumPy update of them says, for
    random caches with empty slots, evictions and writes that are dropped (-1)."""
    rng = np.random.default_rng(0)
    num_experts, num_cache, admitted = 16, 6, 4
    jitted = jax.jit(admitted_tables)
    for _ in range(20):
        expert_in_slot = np.full(num_cache, -1, np.int32)
        filled = rng.choice(num_cache, rng.integers(0, num_cache + 1), replace=False)
        expert_in_slot[filled] = rng.choice(num_experts, len(filled), replace=False)
        slot_of_expert = np.full(num_experts, -1, np.int32)
        slot_of_expert[expert_in_slot[filled]] = filled
        uncached = np.flatnonzero(slot_of_expert < 0)
        experts = rng.choice(uncached, admitted, replace=False).astype(np.int32)
        destinations = rng.choice(num_cache, admitted, replace=False).astype(np.int32)
        destinations[rng.random(admitted) < 0.3] = -1
        want_slot_of, want_in_slot = slot_of_expert.copy(), expert_in_slot.copy()
        for expert, slot in zip(experts, destinations):
            if slot >= 0:
                if want_in_slot[slot] >= 0:
                    want_slot_of[want_in_slot[slot]] = -1
                want_slot_of[expert], want_in_slot[slot] = slot, expert
        slots = LayerSlots(jnp.zeros((num_cache, 1)), jnp.asarray(slot_of_expert), jnp.asarray(expert_in_slot))
        got, evicted = jitted(slots, jnp.asarray(experts), jnp.asarray(destinations))
        np.testing.assert_array_equal(got.slot_of_expert, want_slot_of)
        np.testing.assert_array_equal(got.expert_in_slot, want_in_slot)
        assert evicted == sum(expert_in_slot[slot] >= 0 for slot in destinations if slot >= 0)
    ids = jnp.asarray([[3, -1], [15, 3]], jnp.int32)
    np.testing.assert_array_equal(needed_experts(ids, num_experts), np.isin(np.arange(num_experts), [3, 15]))
    # The disk tier's row space: rows 0..4 hold experts 7, 2, 9 (rows 1 and 4 empty); the rest are on disk only.
    host_rows = np.full(num_experts, -1, np.int32)
    host_rows[[7, 2, 9]] = [0, 2, 3]
    marked = np.isin(np.arange(num_experts), [2, 9, 11])
    np.testing.assert_array_equal(rows_marked(jnp.asarray(host_rows), jnp.asarray(marked), 5),
                                  [False, False, True, True, False])
    by_row = rows_as_slots(slots, jnp.asarray(host_rows), 5)
    want_rows = np.where(np.arange(5)[:, None] == host_rows, np.arange(num_experts), -1).max(axis=1)  # expert per row
    np.testing.assert_array_equal(by_row.slot_of_expert, np.where(want_rows >= 0, slot_of_expert[want_rows], -1))
    for lowered in (jitted.lower(slots, jnp.asarray(experts), jnp.asarray(destinations)),
                    jax.jit(needed_experts, static_argnums=1).lower(ids, num_experts),
                    jax.jit(rows_marked, static_argnums=2).lower(jnp.asarray(host_rows), jnp.asarray(marked), 5),
                    jax.jit(rows_as_slots, static_argnums=2).lower(slots, jnp.asarray(host_rows), 5)):
        assert "scatter" not in lowered.as_text()
