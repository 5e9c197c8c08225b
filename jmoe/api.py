"""The public entry points: `jmoe.load` and the `Model` it returns."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.arguments import check_backend
from jmoe.checkpoint.loading import load_model
from jmoe.checkpoint.orbax_store import restore_model
from jmoe.checkpoint.tokenizer import TextTokenizer, load_tokenizer
from jmoe.compile_cache import enable_compile_cache
from jmoe.config import ModelConfig
from jmoe.decode.generation import RoutingOverride, TokenCallback, as_rows, check_token_ids, generate_tokens
from jmoe.decode.sampling import SamplingParams
from jmoe.decode.chain import StepChain, chains
from jmoe.decode.steps import make_logits_fn, make_step_fn
from jmoe.decode.streaming import stdout_streamer
from jmoe.errors import InputError, NonFiniteError
from jmoe.kernels import FORMATS
from jmoe.memory import sharding_for
from jmoe.model import MoETransformer
from jmoe.model.params import StepParams, flat_params
from jmoe.offload.engine import make_engine
from jmoe.offload.expert_parallel import ExpertParallelEngine, device_placement, expert_mesh, param_sharding
from jmoe.offload.options import OffloadOptions
from jmoe.offload.placement import Placement, is_expert_param, moe_position, plan_placement
from jmoe.offload.policies import CachePolicy
from jmoe.offload.resident import ResidentEngine
from jmoe.plan.headers import read_headers
from jmoe.plan.planner import refuse_if_unfit


class DispatchedStep(NamedTuple):
    """A generation step enqueued on the device (Model.dispatch_step), not yet read back."""

    index: int  # the step's number: 0 is the prompt
    outputs: tuple  # (next tokens int32 [B, 1], bool [L] each decoder layer's output finite), on the device
    routing: jax.Array
    kv_cache: object
    readback: tuple  # what the engine's manager reads of the state the step returned

    @property
    def next_tokens(self) -> jax.Array:
        """int32 [B, 1]: the next step's tokens as it takes them."""
        return self.outputs[0]


def check_finite_layers(finite: np.ndarray, what: str) -> None:
    """NonFiniteError naming the first decoder layer whose output had NaN or inf (finite: bool [L])."""
    if not finite.all():
        layer = int(np.argmin(finite))
        raise NonFiniteError(f"{what}: decoder layer {layer} (of {len(finite)}) produced NaN or infinite values, so "
                             f"every later token would be meaningless; the weights of that layer or those before "
                             f"it are broken: check the checkpoint with jmoe.load(..., check_finite=True)")


class Model:
    """A loaded MoE language model with its expert engine and (optionally) its tokenizer."""

    def __init__(self, module: MoETransformer, config: ModelConfig, engine, tokenizer: TextTokenizer | None = None,
                 source: Path | None = None, progress: bool = False):
        self.config = config
        self.progress = progress  # say on stderr what is compiled, and how long it took
        self.engine = engine
        self.tokenizer = tokenizer
        self.source = source
        if engine.mesh is None:  # the CPU kernels' per-expert views are of one device's whole arrays
            for block in module.moe_blocks():
                block.experts.hold_per_expert_arrays()
        engine.attach(module.moe_layer_views())
        self.graphdef, self.params = nnx.split(module)
        self._step_params = StepParams.of(self.params)
        self.kv_dtype = module.embed[...].dtype
        # A deep model's programs chained in blocks of layers (jmoe.decode.chain), the serving engine's too.
        self.step_chain = StepChain(module, engine) if chains(config, engine) else None
        if self.step_chain is None:
            self._logits_fn = make_logits_fn(self.graphdef, engine, self.kv_dtype)
            self._step_fns = {greedy: make_step_fn(self.graphdef, engine, greedy) for greedy in (True, False)}
        else:
            self._logits_fn = self.step_chain.logits_program(self.kv_dtype)
            self._step_fns = {greedy: self.step_chain.step_program(greedy) for greedy in (True, False)}
        # compiled steps (Compiled, or ChainedCompiled) by (greedy, input shapes)
        self._programs: dict[tuple, Callable] = {}
        self.compile_seconds = 0.0  # spent compiling generation steps so far

    def close(self) -> None:
        """Stop what the model runs besides its steps (the disk tier's reader threads and files)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def compiled_programs(self) -> int:
        """How many generation-step programs have been compiled (one per greedy/sampling mode and shape; a chained
        one, jmoe.decode.chain, counts once)."""
        return len(self._programs)

    def compiled_steps(self) -> list[dict]:
        """The generation steps compiled so far: per program its tokens shape [B, T], whether it is the
        greedy one, and its optimized HLO text (jmoe.plan.hlo.control_flow reads what it does; a chained step's
        pieces in the order they run)."""
        return [{"tokens": inputs[0][0], "greedy": greedy, "hlo": program.as_text()}
                for (greedy, _, _, inputs), program in self._programs.items()]

    def module(self) -> MoETransformer:
        """The Flax NNX module (for research code: inspect, fine-tune, call directly). It reads its stacked expert
        weights only: the per-expert views this Model's own steps read on a CPU share those weights' buffers, so
        after a weight update they would hold the old values."""
        module = nnx.merge(self.graphdef, self.params)
        for block in module.moe_blocks():
            block.experts.drop_views()
        return module

    @property
    def placement_plan(self) -> Placement:
        """Where every parameter lives, the slot counts and the byte totals (the engine owns it)."""
        return self.engine.placement

    def placement(self) -> dict[str, dict]:
        """Per parameter: its memory kind and bytes."""
        return self.placement_plan.as_dict()

    @property
    def step_params(self) -> StepParams:
        """The parameters as the compiled steps take them (flattened once, again only if `params` is replaced)."""
        if self._step_params.state is not self.params:
            self._step_params = StepParams.of(self.params)
        return self._step_params

    def finish_step(self, readback, routing, extra=()):
        """The one device-to-host read of a step: the engine's readback the step returned, its routing and whatever
        the caller needs (its host copy is returned); the engine's manager then plans the next step into the engine
        state (jmoe.serve's steps use it too). Whoever ran the step has made the state it returned the engine's, so
        the next step may be dispatched before this (the manager's tables are then a step old: still correct)."""
        tables, routing_host, extra_host = jax.device_get((readback, routing, extra))
        self.engine.after_step(tables, routing_host)
        return extra_host

    def logits(self, token_ids) -> jax.Array:
        """int [B, T] -> float32 logits [B, T, V] from one full forward (no padding, no cache reuse)."""
        return self.logits_and_routing(token_ids)[0]

    def logits_and_routing(self, token_ids) -> tuple[jax.Array, np.ndarray]:
        """Like logits, plus the expert ids each MoE layer chose: int32 [L_moe, B, T, k] (NumPy)."""
        rows = as_rows(token_ids)
        check_token_ids(self.config, rows, "logits")
        if len({len(r) for r in rows}) != 1:
            raise InputError(f"logits: all rows must have the same length, found lengths "
                             f"{sorted({len(r) for r in rows})}; pad them yourself or call once per row")
        logits, routing, self.engine.state, readback = self._logits_fn(self.step_params, self.engine.state,
                                                                       jnp.asarray(rows, jnp.int32))
        return logits, self.finish_step(readback, routing, routing)

    def run_step(self, tokens, kv_cache, write_index: int, pad_len, key, step: int, sampling: SamplingParams,
                 forced_routing: np.ndarray | None = None):
        """One jitted generation step; returns (next tokens as NumPy [B], the updated kv cache).

        forced_routing: None, or int [L_moe, B, T, k] expert ids replacing the routers' choice.
        A step of several tokens per row is a prompt: it is written from cache column 0.
        """
        step = self.dispatch_step(tokens, kv_cache, write_index, pad_len, key, step, sampling, forced_routing)
        return self.finish_dispatched(step), step.kv_cache

    def dispatch_step(self, tokens, kv_cache, write_index: int, pad_len, key, step: int, sampling: SamplingParams,
                      forced_routing: np.ndarray | None = None) -> DispatchedStep:
        """run_step's first half: the step enqueued on the device (JAX dispatches asynchronously), its outputs
        still device arrays; the engine state it returns is already the engine's, so the next step can be
        dispatched on it (`tokens` may be this one's `next_tokens`) before `finish_dispatched(step)`."""
        if tokens.shape[1] > 1 and write_index != 0:
            raise InputError(f"run_step: a step of {tokens.shape[1]} tokens per row is a prompt and must start at "
                             f"cache column 0, got write_index={write_index}; feed later tokens one per step")
        arrays = None if sampling.greedy else sampling.arrays(tokens.shape[0])
        forced = None if forced_routing is None else jnp.asarray(forced_routing, jnp.int32)
        # NumPy scalars: the compiled call takes them in its own transfer (a jnp scalar dispatches a program each)
        args = (self.step_params, self.engine.state, tokens, kv_cache, np.int32(write_index), pad_len, key,
                np.int32(step), arrays, forced)
        outputs, routing, kv_cache, self.engine.state, readback = self._program(sampling.greedy, args)(*args)
        return DispatchedStep(step, outputs, routing, kv_cache, readback)

    def finish_dispatched(self, step: DispatchedStep) -> np.ndarray:
        """A dispatched step's next tokens as NumPy [B], after its one device-to-host read and the engine's
        bookkeeping (finish_step); NonFiniteError if a layer's output was not finite."""
        next_tokens, finite = self.finish_step(step.readback, step.routing, step.outputs)
        check_finite_layers(finite, f"generation step {step.index}")
        return next_tokens[:, 0]

    def _program(self, greedy: bool, args) -> jax.stages.Compiled:
        """The compiled step for these inputs' shapes, compiled (and timed) the first time they are seen."""
        # The parameters and the engine state keep their shapes for the model's lifetime, but for what set_policy
        # may change (engine.varying_shapes).
        inputs = args[2:]
        key = (greedy, self.engine.varying_shapes(), jax.tree.structure(inputs),
               tuple((a.shape, a.dtype) for a in jax.tree.leaves(inputs)))
        program = self._programs.get(key)
        if program is None:
            tokens, kv_cache = args[2], args[3]
            what = (f"the {'prompt' if tokens.shape[1] > 1 else 'decode'} step ({tokens.shape[0]} x {tokens.shape[1]} "
                    f"tokens, {jax.tree.leaves(kv_cache)[0].shape[1]} cache columns, {self.config.num_layers} layers"
                    f"{'' if self.step_chain is None else ', chained'})")
            if self.progress:
                print(f"compiling {what} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            program = self._programs[key] = self._step_fns[greedy].lower(*args).compile()
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            if self.progress:
                print(f"compiled {what} in {seconds:.1f} s", file=sys.stderr, flush=True)
        return program

    def generate(self, prompt_ids, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, on_tokens: TokenCallback | None = None) -> list[list[int]]:
        """New token ids for each prompt (a list of ints, or a batch of them of any lengths).

        Stops a row at an EOS id of config.json / generation_config.json (the EOS is included) or after
        `max_new_tokens`. `on_tokens` is called after every step with the tokens so far.
        """
        return self.generate_detailed(as_rows(prompt_ids), max_new_tokens, SamplingParams(temperature, top_k, top_p),
                                      seed, on_tokens).tokens

    def generate_detailed(self, rows: list[list[int]], max_new_tokens: int, sampling: SamplingParams, seed: int = 0,
                          on_tokens: TokenCallback | None = None, routing_override: RoutingOverride | None = None,
                          run_ahead: bool = True):
        """Like generate, returning a GenerationResult with timings (used by the CLI and benchmarks).

        routing_override: (step, tokens shape) -> expert ids replacing the routers' choice (benchmarks
        that drive a random-weight model from a recorded trace, jmoe.traces.forced_routing).
        run_ahead: dispatch each step before the host has read the last one back (the engine's manager then plans
        from tables a step old; the tokens are the same); False waits for each step (benchmarks compare them).
        """
        return generate_tokens(self, rows, max_new_tokens, sampling, seed, on_tokens, routing_override, run_ahead)

    def require_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise InputError(f"{self.source}: no tokenizer.json in the model directory; text generation needs "
                             f"one (or pass token ids to generate())")
        return self.tokenizer

    def generate_text(self, prompt: str | Sequence[str], max_new_tokens: int = 32, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int = 0, stream: bool = False) -> str | list[str]:
        """Generated text for one prompt (str) or several (list of str). `stream` prints text as it arrives."""
        tokenizer = self.require_tokenizer()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not all(isinstance(p, str) for p in prompts):
            found = type(prompt).__name__ if isinstance(prompt, str | bytes) else [type(p).__name__ for p in prompts]
            raise InputError(f"generate_text: expected a str or a list of str, found {found}; "
                             f"decode bytes first (e.g. prompt.decode('utf-8'))")
        if any(not p for p in prompts):
            raise InputError("generate_text: empty prompt; give some text to continue")
        if stream and len(prompts) != 1:
            raise InputError(f"generate_text: stream=True needs exactly one prompt, found {len(prompts)}")
        ids = self.generate([tokenizer.encode(p) for p in prompts], max_new_tokens, temperature, top_k, top_p,
                            seed, stdout_streamer(tokenizer) if stream else None)
        texts = [tokenizer.decode(t) for t in ids]
        return texts[0] if isinstance(prompt, str) else texts

    def set_policy(self, policy) -> None:
        """Empty the expert cache and continue with another policy (name or CachePolicy). No recompilation, but
        the first decode step after switching between a policy that admits misses and one that does not (static):
        their decode steps differ, misses admitted or computed from scratch slots."""
        self.engine.reset(OffloadOptions(policy=policy).policy)

    def stats(self) -> list[dict]:
        """Per MoE layer: hits, misses, evictions, bytes moved (empty when every expert is resident). Over an
        expert mesh, one row per device and layer, its position on the expert axis under "device"."""
        return self.engine.stats()


# jmoe.load checks Hugging Face weights for NaN and inf by default up to this size (one more pass over them).
CHECK_FINITE_BYTES = 4 * 2**30


def load(path: str | Path, cache: int | Sequence[int | None] | None = None, *, policy: str | CachePolicy = "lfru",
         offload_params: list[str] | None = None, device_budget_gb: float | None = None, prefetch: int = 0,
         miss_mode: str = "fetch", offload_group_size: int = 0, offload_num_in_group: int = 1,
         offload_prefetch_step: int = 1, cpu_moe_layers: int = 0, prefetch_trace=None,
         expert_dtype: str | None = None, expert_group_size: int | None = None, dtype: str | None = None,
         backend: str = "auto", progress: bool = True, compile_cache: bool | str | Path | None = None,
         check_memory: bool = True, check_finite: bool | None = None, devices: int | None = None,
         mesh: jax.sharding.Mesh | None = None, host_budget_gb: float | None = None,
         read_ahead: int = 0, scratch_rows: int = 8, direct_reads: bool | None = None,
         side_stream_copies: bool = False) -> Model:
    """Load a MoE checkpoint: a Hugging Face safetensors directory or one made by `python -m jmoe.convert`.

    cache: experts per MoE layer kept on the device; None (or >= the number of experts) keeps all. One
        number for every MoE layer, or a list with one value per MoE layer (None = that layer resident).
    policy: cache policy name ("lru", "lfu", "lfru", "static") or a jmoe.offload.policies.CachePolicy.
    offload_params: more parameters to keep in pinned host memory, by dotted-segment name ("w_down",
        "attn") or by regular expression ("re:layers\\.(1[0-9])\\..*experts").
    device_budget_gb: choose the largest cache that fits in this much device memory.
    prefetch: at decode, copy up to this many experts per layer ahead of need, guessed by applying the
        next layer's router to the current layer's input (results unchanged; 0 = off).
    prefetch_trace: prefetch by routing history instead: the replay's recommended predictor (`--prefetch
        best`: co-occurrence with the layers just before, the previous token and recent use) fitted on this
        routing trace of the model (a .npy file or int array [tokens, MoE layers, k]); as each layer routes,
        up to 4 experts of the next layer are copied ahead (jmoe.offload.history_prefetch).
    miss_mode: where an expert that is not in a device slot is computed: "fetch" copies its weights to the
        device; "host" computes it on the host where its weights live (only activations cross) and brings
        it into the cache for later steps in the background; "direct" is "host" with the missed experts computed
        on a GPU straight from pinned host memory (the expert kernel reads their weights over the host link, no
        copy into slots first; on other platforms, as "host"). Results are the same every way.
    offload_group_size, offload_num_in_group, offload_prefetch_step: layer-group weight prefetch for
        models whose dense weights do not fit either: in every group of G decoder layers the last N keep
        their weights (those matched by offload_params; without patterns, all non-expert weights) in
        pinned host memory, and each is copied in when the layer K before it starts. 0 = off.
    cpu_moe_layers: keep every expert of the first N MoE layers in pinned host memory (cache 0 there; the
        other layers follow `cache`); with miss_mode="host" they are also computed there.
    expert_dtype: how the routed experts are stored in host memory, in the device slots and in every copy
        between them: None = as the checkpoint stores them; "float32" / "bfloat16"; or quantized at load,
        "int8" (per output column), "int4" (per group of expert_group_size input rows, default 64), "fp8"
        (e4m3, 128x128 blocks) or "mxfp4" (e2m1, e8m0 scale per 32): 2-8x fewer bytes per expert, computed
        by dequantizing inside the expert kernel (formats: jmoe.kernels.quantized).
    expert_group_size: int4's rows per scale; must divide hidden_size and the expert width.
    dtype: parameter dtype (default: the checkpoint's `dtype` in config.json).
    backend: expert kernel backend for jmoe.kernels.moe_ffn.
    progress: show a progress bar and print the placement summary to stderr.
    compile_cache: JAX's persistent compilation cache, so a second run skips compiling: None = the
        JMOE_COMPILE_CACHE environment variable (a directory or "off"), else ~/.cache/jmoe/jax; True = that
        default; False = off; a path = that directory. A cache directory already configured in JAX wins.
    check_memory: before reading any weight, plan the memory from the checkpoint headers (as jmoe.plan does
        for this machine, batch 1, the default context) and raise InsufficientMemoryError, with the numbers
        and what to change, when it does not fit. False skips the check.
    check_finite: refuse weights holding NaN or inf (CheckpointError naming the parameter). None = check
        Hugging Face checkpoints of up to CHECK_FINITE_BYTES (4 GiB) of weights, where the extra pass costs
        little; True / False = always / never. Converted checkpoints were checked when converted.
    devices: expert parallelism: split every MoE layer's experts evenly over this process's first N devices
        (N must divide the number of experts); each device keeps its own `cache` slots per layer (`cache`,
        device_budget_gb and the placement summary count per device) and its own cache policy, and stats()
        has a row per device and layer. Results equal one device's. None or 1 = one device.
    mesh: the same over a jax.sharding.Mesh whose one axis is named "expert" (jmoe.offload.expert_parallel).
    host_budget_gb: the disk tier (jmoe.offload.host_tier): the offloaded layers keep this many GB of their
        experts in pinned host memory, the rest are read from the checkpoint files when a step needs them.
        Results are the same. Close the model (`close()`, or `with`) to stop its reader threads. With
        prefetch_trace, its predictor reads ahead from disk instead of copying to the device.
    read_ahead: with host_budget_gb and prefetch_trace, as each layer routes start reading this many experts of
        the next layer, those in no host row the predictor scores best given this token's layers so far (the first
        layer's between steps); the budget holds them (this many experts of one layer). 0 = off.
    scratch_rows: the scratch slots the offloaded layers share hold the missed experts of this many decode rows
        (scratch_rows x top_k, at most the experts per layer); a step that misses more computes the rest on the
        host, and prefill streams experts through chunks of that many. Fewer hold less device memory: a disk
        tier decoding one row needs 1. Results are the same.
    direct_reads: with host_budget_gb, read the experts on disk past the page cache (O_DIRECT: a fifth of the CPU
        per byte, no page cache hits). None = when the page cache has room for under a quarter of them (its room:
        the machine's available memory, or the process's memory cgroup limit, less the host budget); the choice
        is printed with the placement summary. Results are the same.
    side_stream_copies: on a GPU, run the decode step's copies made ahead of need (prefetch, prefetch_trace, and
        the admissions miss modes "host" and "direct" plan for the next step) as asynchronous calls on a second
        stream, so that the kernels XLA schedules between a copy's start and its done (the layers before the one
        it fills, as XLA's scheduler chooses) run beside it. Results are the same; other platforms are unchanged.
        Needs one of those copies (InputError otherwise). Off by default until a GPU has measured it against the
        copies on the compute stream (python -m bench.gpu_decode_bound).
    """
    options = OffloadOptions(cache, policy, offload_params, device_budget_gb, prefetch, miss_mode,
                             offload_group_size, offload_num_in_group, offload_prefetch_step, cpu_moe_layers,
                             prefetch_trace, expert_dtype, expert_group_size, devices, mesh, host_budget_gb,
                             read_ahead, scratch_rows, direct_reads, side_stream_copies)
    return load_with_options(path, options, dtype=dtype, backend=backend, progress=progress,
                             compile_cache=compile_cache, check_memory=check_memory, check_finite=check_finite)


def load_with_options(path: str | Path, options: OffloadOptions, *, dtype: str | None = None, backend: str = "auto",
                      progress: bool = True, compile_cache: bool | str | Path | None = None,
                      check_memory: bool = True, check_finite: bool | None = None) -> Model:
    """`load` with the offload settings already gathered in an OffloadOptions (the command lines use this)."""
    check_backend(backend)
    enable_compile_cache(compile_cache)
    # config and checkpoint headers, checked; no tensor data read yet
    headers = read_headers(path, dtype, options.expert_dtype, options.expert_group_size)
    model_dir, config, dtype = headers.directory, headers.config, headers.dtype
    mesh = expert_mesh(options)  # None: one device
    placement = device_placement(config, headers.abstract, options, 1 if mesh is None else mesh.devices.size)

    def sharding(path):
        kind = placement.memory_kind_of(path)
        return sharding_for(kind) if mesh is None else param_sharding(mesh, path, kind)

    if check_memory:
        refuse_if_unfit(headers, placement, 1 if mesh is None else mesh.devices.size)
    tiered = set(placement.offloaded_layers) if placement.host_rows else set()

    def unread(path):  # the disk tier's experts: its reader fills their host rows (jmoe.offload.host_tier)
        return is_expert_param(path) and moe_position(config, path) in tiered

    if headers.format == "jmoe-orbax":
        module = restore_model(model_dir, config, dtype=dtype, sharding_of=sharding, progress=progress, unread=unread)
    else:
        if check_finite is not None and not isinstance(check_finite, bool):
            raise InputError(f"check_finite must be True, False or None, found {check_finite!r}")
        if check_finite is None:
            check_finite = headers.stored_bytes <= CHECK_FINITE_BYTES
        module = load_model(model_dir, config, dtype=dtype, progress=progress, check_finite=check_finite,
                            place=lambda p, host: jax.device_put(host, sharding(p)), unread=unread)
    if progress:
        print(placement.summary(), file=sys.stderr)
    engine = (make_engine(config, placement, options, backend) if mesh is None
              else ExpertParallelEngine(config, placement, options, backend, mesh))
    if tiered:
        from jmoe.checkpoint.expert_reader_orbax import open_expert_reader

        engine.tier_reader = open_expert_reader(model_dir, config, dtype=dtype,
                                                direct=direct_tier_reads(config, placement, options, progress))
    return Model(module, config, engine, load_tokenizer(model_dir), model_dir, progress)


def direct_tier_reads(config: ModelConfig, placement: Placement, options: OffloadOptions, progress: bool) -> bool:
    """options.direct_reads, or where it is None whether the disk tier's reads pay going past the page cache."""
    direct, why = options.direct_reads, f"direct_reads={options.direct_reads}"
    if direct is None:
        from jmoe.checkpoint.read_buffers import direct_reads_pay
        from jmoe.plan import resources

        on_disk = (config.num_experts - placement.host_rows) * placement.layer_expert_bytes
        room, bound = resources.page_cache_room(int(options.host_budget_gb * 1e9))  # less the rows it will fill
        direct, why = direct_reads_pay(on_disk, room, bound)
        why += "; direct_reads=None decides, set it to choose"
    if progress:
        print(f"disk tier: {'direct' if direct else 'buffered'} reads ({why})", file=sys.stderr)
    return direct


def random_model(config: ModelConfig, seed: int = 0, backend: str = "auto") -> Model:
    """A randomly initialised model with every parameter on the device (tests, benchmarks, training)."""
    check_backend(backend)
    if config.expert_dtype in FORMATS:
        raise InputError(f"random_model makes float experts; expert_dtype={config.expert_dtype!r} is applied when "
                         f"loading: save the random model as a checkpoint and jmoe.load it with expert_dtype")
    module = MoETransformer(config, rngs=nnx.Rngs(seed))
    placement = plan_placement(config, flat_params(nnx.to_pure_dict(nnx.state(module))))
    return Model(module, config, ResidentEngine(config, placement, backend))
