"""Layer-group weight prefetch: for models whose non-expert weights do not fit on the device either.

In every group of `group_size` consecutive decoder layers, the last `num_in_group` keep their selected weights in pinned
host memory. Inside the jitted step, when layer i starts, the weights of the offloaded layer i + `prefetch_step` are
copied to the device, so the copy overlaps layers i .. i + K - 1 (the first K layers' copies start with the step; in a
chained step, with each block of layers). Each copy is tied to layer i's input with an optimization barrier: XLA may not
start it earlier, so at most the offloaded layers among i .. i + K are ever on the device at once. Those device copies
are the buffers XLA assigns statically at compile time.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jmoe.arguments import is_whole_number
from jmoe.errors import InputError
from jmoe.memory import to_device
from jmoe.model.params import param_key


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    group_size: int  # G: layers per group
    num_in_group: int  # N: offloaded layers per group (the last N of each group)
    prefetch_step: int  # K: a layer's weights are fetched when the layer K before it starts

    def __post_init__(self):
        g, n, k = self.group_size, self.num_in_group, self.prefetch_step
        if not all(is_whole_number(v) for v in (g, n, k)):
            raise InputError(f"offload group settings must be whole numbers, found group size {g!r}, "
                             f"num in group {n!r}, prefetch step {k!r}")
        if g < 1:
            raise InputError(f"offload group size must be >= 1 layer, found {g}")
        if not 1 <= n <= g:
            raise InputError(f"offload num in group must be between 1 and the group size {g}, found {n}")
        if k < 1:
            raise InputError(f"offload prefetch step must be >= 1 layer ahead, found {k} (a layer's weights "
                             f"have to be on their way before it starts)")

    def offloaded(self, layer: int) -> bool:
        return layer % self.group_size >= self.group_size - self.num_in_group

    def fetched_at(self, layer: int) -> int:
        """The layer whose start issues this offloaded layer's copy."""
        return max(0, layer - self.prefetch_step)

    def describe(self) -> str:
        return (f"{self.num_in_group} of every {self.group_size} layers fetched {self.prefetch_step} "
                f"layer(s) ahead")


def prefetch_buffer_bytes(groups: LayerGroups, layer_bytes: dict[int, int], num_layers: int) -> int:
    """Most bytes of fetched layer weights on the device at once: when layer i runs, the offloaded layers
    among i .. i + K have been fetched and not all used."""
    return max((sum(layer_bytes.get(j, 0) for j in range(i, min(num_layers, i + groups.prefetch_step + 1)))
                for i in range(num_layers)), default=0)


def layer_fetch_hook(groups: LayerGroups, fetched: tuple[tuple[str, ...], ...], layers: list):
    """A `before_layer(i, stream) -> stream` callback for a run of consecutive decoder layers (a whole model's, or a
    chained step's block: positions count from the run's first): at the start of layer i, copy the offloaded weights
    of the layers whose copy it issues (`groups.fetched_at`, so the run's first layers' at its start) to the device and
    put the copies in the (traced) modules. `fetched[j]`: the names within layer j of its weights fetched ahead."""
    variables = [{param_key(path): node for path, node in nnx.iter_graph(layer) if isinstance(node, nnx.Variable)}
                 for layer in layers]
    issue_at: dict[int, list[int]] = {}
    for layer, keys in enumerate(fetched):
        if keys:
            issue_at.setdefault(groups.fetched_at(layer), []).append(layer)

    def before_layer(i: int, stream: tuple) -> tuple:
        for layer in issue_at.get(i, ()):
            keys = fetched[layer]
            # The barrier makes the copies depend on layer i's input, so they cannot be hoisted earlier.
            stream, host_values = jax.lax.optimization_barrier((stream, [variables[layer][k][...] for k in keys]))
            for key, value in zip(keys, host_values):
                variables[layer][key][...] = to_device(value)
        return stream

    return before_layer


def layer_groups_from(group_size: int, num_in_group: int = 1, prefetch_step: int = 1) -> LayerGroups | None:
    """The settings of `--offload-group-size G --offload-num-in-group N --offload-prefetch-step K`; group size
    0 means off, and then the other two must keep their defaults (they would be silently ignored)."""
    if group_size == 0:
        if (num_in_group, prefetch_step) != (1, 1):
            raise InputError(f"offload num in group ({num_in_group}) and prefetch step ({prefetch_step}) need an "
                             f"offload group size >= 1 (found 0 = layer groups off)")
        return None
    return LayerGroups(group_size, num_in_group, prefetch_step)
