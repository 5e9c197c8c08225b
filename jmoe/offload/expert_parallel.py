"""Expert parallelism inside one process: every MoE layer's experts split over the devices of a mesh axis.

The device at position d of an N-device `expert` axis owns experts [d*E/N, (d+1)*E/N) of every MoE layer:
their weights (pinned host memory when offloaded, else device memory) are sharded on that axis, and it runs
its own engine as if the model had E/N experts: its own cache slots (`cache` counts per device), scratch
slots, slot tables and manager (policy state, statistics). Dense weights, the KV cache and the tokens are
replicated: every device runs the attention and the routers (over all E experts), so no activation but the MoE layers'
outputs crosses between devices. Each jitted step runs `jmoe.decode.steps.forward` under shard_map (a deep model's
chained step, each block's program: jmoe.decode.chain): a device maps the routers' choice to its own experts
(`ResidentEngine.owned`; the others' become -1, routed nowhere here), computes its share with the one-device machinery
(slots, scratch copies, host compute, prefill streaming), and one psum per MoE layer adds the float32 partial outputs
before the one rounding (`ResidentEngine.combine`). The engine state has a leading device axis sharded over the mesh;
between steps each device's manager reads its own row of the step's tables.

In a jax.distributed run each process splits the experts over its own devices (a mesh spanning processes is
refused). Not under a mesh: the CPU kernels' per-expert views of resident experts (Experts.hold_per_expert_arrays; the
CPU kernels read the stacked arrays instead) and history prefetch (`prefetch_trace`).
jmoe.plan compiles the steps for N GPUs of one host with this engine (`devices=N`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmoe.config import ModelConfig
from jmoe.errors import InputError
from jmoe.model.params import ParamPath
from jmoe.offload.engine import OffloadEngine, make_engine
from jmoe.offload.options import OffloadOptions
from jmoe.offload.placement import Placement, is_expert_param, plan_placement

EXPERT_AXIS = "expert"


def expert_mesh(options: OffloadOptions) -> Mesh | None:
    """The mesh `options` asks for (`devices` = N: this process's first N devices on an `expert` axis; or
    `mesh`, whose only axis must be `expert`); None = one device. device_placement checks that the model's
    experts split evenly over it."""
    if options.mesh is not None:
        mesh = options.mesh
        if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (EXPERT_AXIS,):
            found = (f"a Mesh with axes {tuple(mesh.axis_names)}" if isinstance(mesh, Mesh)
                     else type(mesh).__name__)
            raise InputError(f"mesh must be a jax.sharding.Mesh with one axis named {EXPERT_AXIS!r}, found {found}; "
                             f"make it with jax.make_mesh((N,), ({EXPERT_AXIS!r},)) or pass devices=N instead")
        others = sorted({d.process_index for d in mesh.devices.flat} - {jax.process_index()})
        if others:
            raise InputError(f"the mesh has devices of other processes ({others}); experts are split over one "
                             f"process's devices only (each process of a jax.distributed run holds the whole model): "
                             f"build the mesh from jax.local_devices(), or pass devices=N")
    elif options.devices is None or options.devices == 1:
        return None
    else:
        local = jax.local_devices()
        if options.devices > len(local):
            raise InputError(f"devices={options.devices}, but this process sees {len(local)} "
                             f"{local[0].platform.upper()} device(s); give at most {len(local)} (on CPU, "
                             f"JAX_NUM_CPU_DEVICES={options.devices} makes that many)")
        mesh = Mesh(np.array(local[:options.devices]), (EXPERT_AXIS,))
    return mesh


def check_expert_split(devices: int, config: ModelConfig) -> None:
    """Refuse an expert axis of `devices` that the model's experts do not split evenly over."""
    experts = config.num_experts
    if experts % devices:
        fits = [k for k in range(1, experts + 1) if experts % k == 0]
        raise InputError(f"the expert axis has {devices} devices, but the model's {experts} experts per MoE layer do "
                         f"not split evenly over them: expected a device count that divides {experts} "
                         f"({', '.join(map(str, fits))}), found {devices}; change devices (--devices) or the mesh")


def device_config(config: ModelConfig, n: int) -> ModelConfig:
    """The config one device of an `n`-device expert axis sees in its engine and placement: its share of the
    experts (the routers still choose among all of them, with the model's own config)."""
    return config.replace(num_experts=config.num_experts // n)


def device_placement(config: ModelConfig, abstract: dict[ParamPath, object], options: OffloadOptions,
                     n: int) -> Placement:
    """The placement of one device of an `n`-device expert axis: its share of every MoE layer's experts, the dense
    weights (replicated), its slots. Every byte count in it is per device. One device: the model's placement.
    Refuses an `n` that does not divide the model's experts."""
    if n == 1:
        return plan_placement(config, abstract, options)
    check_expert_split(n, config)
    own = {path: jax.ShapeDtypeStruct((a.shape[0] // n, *a.shape[1:]), a.dtype) if is_expert_param(path) else a
           for path, a in abstract.items()}
    placement = plan_placement(device_config(config, n), own, options)
    note = (f"expert parallel over {n} devices: each holds {config.num_experts // n} of the {config.num_experts} "
            f"experts of every MoE layer, its own slots and a copy of the dense weights; the byte counts above "
            f"are per device")
    return dataclasses.replace(placement, notes=placement.notes + (note,))


def param_spec(path: ParamPath) -> P:
    """How a parameter is laid out over the mesh: experts split on their first axis, the rest replicated."""
    return P(EXPERT_AXIS) if is_expert_param(path) else P()


def param_sharding(mesh: Mesh, path: ParamPath, memory_kind: str) -> NamedSharding:
    """Where a parameter lives under the mesh (param_spec), in `memory_kind`."""
    return NamedSharding(mesh, param_spec(path), memory_kind=memory_kind)


def param_specs(params):
    """shard_map's in_specs for the model's parameters (an nnx.State): experts split, the rest replicated."""
    def spec(path, _):
        keys = {p.key for p in path if isinstance(p, jax.tree_util.DictKey)}
        return P(EXPERT_AXIS) if "experts" in keys else P()

    return jax.tree_util.tree_map_with_path(spec, params)


def this_device(tree):
    """Inside shard_map: a device's block of a stacked tree [1, ...] -> its own [...]."""
    return jax.tree.map(lambda a: a[0], tree)


def stacked(tree):
    """Inside shard_map: a device's own tree -> its block [1, ...] of the stacked one."""
    return jax.tree.map(lambda a: a[None], tree)


class ExpertParallelEngine:
    """The expert engine of a model whose experts are split over a mesh: one engine per device (each made for
    E/N experts, with its own manager), traced once for all of them under shard_map; the engine interface of
    jmoe.offload.resident, its state stacked over the devices."""

    def __init__(self, config: ModelConfig, placement: Placement, options: OffloadOptions, backend: str, mesh: Mesh):
        self.config, self.mesh, self.placement, self.backend = config, mesh, placement, backend
        self.engines = [make_engine(device_config(config, mesh.devices.size), placement, options, backend)
                        for _ in range(mesh.devices.size)]
        for engine in self.engines:
            engine.expert_axis = EXPERT_AXIS
        self.offloading = isinstance(self.engines[0], OffloadEngine)
        self.runs_ahead = self.engines[0].runs_ahead  # one device's engine decides for all (the same options)
        self.sharding = NamedSharding(mesh, P(EXPERT_AXIS))
        self.replicated = NamedSharding(mesh, P())
        self.state = ()
        self.host_experts: list = []
        self._install = jax.jit(jax.shard_map(
            lambda state, host, experts: stacked(OffloadEngine.filled_slots(this_device(state), host,
                                                                           this_device(experts))),
            mesh=mesh, in_specs=P(EXPERT_AXIS), out_specs=P(EXPERT_AXIS), check_vma=False), donate_argnums=(0,))

    # ---- inside the jitted step: the first device's engine traces for every device -----------------------
    def spmd(self, fn: Callable, params) -> Callable:
        """`fn(params, state, inputs)` run on every device: experts and engine state split, the rest replicated;
        its outputs replicated (ForwardOut, identical on every device after the psums) and the state split.
        Not type-checked for replication (check_vma): the kernels' branches (lax.cond over a slot) would need
        every zero branch marked as varying over the axis."""

        def call(params, state, inputs):
            # Empty leaves of the state (a layer without cache slots, no plan) stay outside: XLA gives an empty
            # array a replicated layout whatever it is asked, which shard_map's split input then refuses.
            leaves, treedef = jax.tree.flatten(state)

            def on_device(params, held, inputs):
                held = iter(held)
                own = [next(held) if a.size else jnp.zeros((1, *a.shape[1:]), a.dtype) for a in leaves]
                out, new_state = fn(params, treedef.unflatten(own), inputs)
                return out, [a for a in jax.tree.leaves(new_state) if a.size]

            out, held = jax.shard_map(on_device, mesh=self.mesh, in_specs=(param_specs(params), P(EXPERT_AXIS), P()),
                                      out_specs=(P(), P(EXPERT_AXIS)), check_vma=False)(
                params, [a for a in leaves if a.size], inputs)
            held = iter(held)
            return out, treedef.unflatten([next(held) if a.size else a for a in leaves])

        return call

    def abstract_state(self, layers) -> object:
        """The stacked state's shapes for abstract `layers`, allocating nothing (compiling for a GPU target)."""
        n = len(self.engines)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype),
                            self.engines[0].abstract_state(layers))

    def prepare_params(self, params):
        return self.engines[0].prepare_params(params)

    def layer_hook(self, model):
        return self.engines[0].layer_hook(model)

    def bind(self, state, layers, tokens_shape: tuple[int, int]):
        compute, finish = self.engines[0].bind(this_device(state), layers, tokens_shape)
        return compute, lambda: stacked(finish())

    # ---- a chained step's blocks (jmoe.decode.chain): each block's program a shard_map of its own ----------------
    def block_span(self, moe_start: int, moe_stop: int):
        return self.engines[0].block_span(moe_start, moe_stop)

    @property
    def host_param_keys(self) -> frozenset:
        return self.engines[0].host_param_keys

    def block_host_params(self, start: int, end: int) -> tuple[frozenset, ...]:
        return self.engines[0].block_host_params(start, end)

    def block_fetched_params(self, start: int, end: int) -> tuple[tuple[str, ...], ...]:
        return self.engines[0].block_fetched_params(start, end)

    def first_carry(self, x):
        return self.engines[0].first_carry(x)  # replicated, as the block's activations

    def block_state(self, state, span):
        return self.engines[0].block_state(state, span)  # every leaf keeps its leading device axis

    def with_block_state(self, state, span, block):
        return self.engines[0].with_block_state(state, span, block)

    def bind_block(self, state, layers, tokens_shape: tuple[int, int], layout, carry):
        compute, finish = self.engines[0].bind_block(this_device(state), layers, tokens_shape, layout, carry)

        def finished():
            block_state, carry_out = finish()
            return stacked(block_state), carry_out

        return compute, finished

    # ---- between steps: every device's manager ------------------------------------------------------------
    def attach(self, layers) -> None:
        if not self.offloading:
            return
        self.host_experts = [layers[i].experts for i in self.engines[0].layers]
        for engine in self.engines:
            engine.host_experts = self.host_experts  # their shapes size the slots
        self.reset(self.engines[0].initial_policy)

    def reset(self, policy) -> None:
        if not self.offloading:
            return
        self.state = None  # release the old slot buffers before allocating new ones
        for engine in self.engines:
            engine.start_managing(policy)
        n, first = len(self.engines), self.engines[0]

        def empty():
            return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), first.empty_state())

        # Each device allocates its own slots: the stacked empty state is made sharded, never whole on one device.
        shardings = jax.tree.map(self.placed, jax.eval_shape(empty))
        self.state = jax.jit(empty, out_shardings=shardings)()._replace(**self._manager_tables())
        self.install_pinned()

    def _manager_tables(self) -> dict:
        tables = [engine.manager_tables() for engine in self.engines]
        stacks = {name: np.stack([t[name] for t in tables]) for name in tables[0]}
        return {name: jax.device_put(a, self.placed(a)) for name, a in stacks.items()}

    def placed(self, a) -> NamedSharding:
        """A stacked state leaf's sharding: split over the devices, or replicated when it is empty (XLA lays
        an empty array out replicated whatever it is asked, and a compiled step checks its inputs' layout)."""
        return self.sharding if a.size else self.replicated

    def varying_shapes(self) -> tuple:
        return self.state.victim_order.shape if self.offloading else ()

    def readback(self, state):
        return self.engines[0].readback(state) if self.offloading else ()

    def after_step(self, tables, routing: np.ndarray) -> None:
        """routing int [L_moe, ...]: the routers' expert ids; each device's manager sees its own experts'."""
        if not self.offloading:
            return
        slot_of_expert, counts = tables
        share = self.engines[0].config.num_experts
        first_observation = False
        for d, engine in enumerate(self.engines):
            local = routing - d * share
            own = np.where((local >= 0) & (local < share), local, -1)
            first_observation = engine.observe((slot_of_expert[d], counts[d]), own)
        self.state = self.state._replace(**self._manager_tables())
        if first_observation:  # policy="static": each device's table comes from this first step
            self.install_pinned()

    def install_pinned(self) -> None:
        """A static policy's experts, installed on every device at once."""
        pinned = [engine.manager.pinned_experts() if any(engine.caches) else None for engine in self.engines]
        if pinned[0] is None:
            return
        experts = tuple(jax.device_put(np.stack([p[i] for p in pinned]).astype(np.int32), self.sharding)
                        for i in range(len(pinned[0])))
        self.state = self._install(self.state, self.host_experts, experts)
        for engine, own in zip(self.engines, pinned):
            engine.note_installed(own)

    def stats(self) -> list[dict]:
        """Per device (its position on the expert axis) and offloaded MoE layer: that device's statistics."""
        return [{"device": d, **row} for d, engine in enumerate(self.engines) for row in engine.stats()]
