"""The disk tier (issue #31): each offloaded layer keeps H of its experts in pinned host rows; the others stay in
the checkpoint files and are read by byte range when a step meets them.

Inclusive: every expert in a device slot is also in a host row (the slots are filled from the rows, and a row
whose expert sits in a slot is never given away), so a device eviction is bookkeeping and the rows are written
only between steps, from what the disk threads read (jmoe.traces.tiers: inclusive at H reads from disk what a
one-level cache of H misses; exclusive would copy every device victim back).

Inside a step (`disk_experts`): the experts a layer needs that are in neither a slot nor a row are read by a
loop whose trip count is their number, each iteration an `io_callback` that returns one expert's weights, computed
by the layer's kernel as one more partial output. The callback keeps the reads of the next experts in flight (up
to k, the router's experts per token: one decode row's, with queue depth for the disk), so an expert computes
while the next ones still arrive, and host memory holds one expert of the layer in the program at a time. No
expert missing: no iteration, no callback. On a GPU each round is a host round trip; the disk read it waits for
(tens of ms for a 39 MB expert) is what costs. A step keeps one of each layer's reads for admission (the
policy's best as of the step's start: the others are let go once computed, so a token's reads never pile up in
memory); between steps (`HostTier.admissions`) the policy's ranking admits it into a row, written in place
(`write_row`: the rows' buffer is donated, so a write costs one expert, not the layer's H). The host budget
counts these staged experts (`STAGED_PER_LAYER`, and the read-ahead's) next to the rows.

Read-ahead (the engine's `read_ahead` option, N): as a layer with disk reads routes, its callback also gets the
N experts of the next offloaded layer that the history predictor scores best with this token's layers so far
(jmoe.offload.history_prefetch's in-step scores: on the GPT-OSS trace its top 4 held 68% of a layer's experts,
against 51% for the same predictor between steps), and submits those in no row; between steps, the first
offloaded layer's (`read_ahead_first_layer`). So a read ahead runs while the layer before its own computes, and
the memory it takes is N experts, not N per layer. Reads ahead queue behind every read a step waits for
(jmoe.checkpoint.read_order: in first-come order they held up the demand reads); a step that needs one raises it
to a demand read and waits only for what is left of it. Once a layer's reads are known, those ahead for it and
earlier layers that it does not need are dropped (a read already running finishes; its result is let go), and
those still held at the next admissions compete for rows like the step's own reads.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.checkpoint.read_order import DEMAND, ReadPriority
from jmoe.kernels import ExpertWeights, QuantizedTensor
from jmoe.kernels.float_bits import as_float_bits, is_float_bits
from jmoe.memory import PINNED_HOST, computed_on_host, sharding_for
from jmoe.offload.slots import chunk_slot_ids, rank_among, slot_ids_of


def expert_weights_from(read: dict[str, np.ndarray], like: ExpertWeights) -> ExpertWeights:
    """One expert read by an ExpertReader ({"w_gate_up", "w_down", biases, "..._scale"}) as an ExpertWeights shaped
    like `like` (quantized weights as QuantizedTensors, 16-bit floats as FloatBits where `like` holds them so), with a
    leading axis of 1."""
    def weight(name):
        stacked = getattr(like, name)
        if stacked is None:
            return None
        if isinstance(stacked, QuantizedTensor):
            return QuantizedTensor(read[name][None], read[f"{name}_scale"][None], stacked.fmt, stacked.group)
        return as_float_bits(read[name][None]) if is_float_bits(stacked) else read[name][None]

    biases = [weight(b) for b in ("b_gate_up", "b_down")]
    return ExpertWeights(weight("w_gate_up"), weight("w_down"), *biases)


def disk_experts(x, ids, weights, on_disk, *, like: ExpertWeights, read_expert, position, kernel, ahead=None):
    """float32 [T, d]: the contribution of the experts marked in `on_disk` (bool [E]), one a round: round r calls
    `read_expert(position, order int32 [E], count int32, r, ahead)` (a host callback returning expert order[r]'s
    leaves of offloaded layer `position` (an int32 scalar array, so that alike layers make alike programs), shaped like
    `like`'s with a leading axis of 1; order[:count] are the marked experts, lowest first) and computes it. `ahead`:
    int32 [N], experts of the next offloaded layer to read ahead (-1: none; None: no read-ahead)."""
    ahead = jnp.zeros((0,), jnp.int32) if ahead is None else ahead.astype(jnp.int32)
    count = jnp.sum(on_disk, dtype=jnp.int32)
    order = jnp.nonzero(on_disk, size=on_disk.shape[0], fill_value=0)[0].astype(jnp.int32)
    token_rank = slot_ids_of(rank_among(on_disk), ids)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), like.stacked())

    def body(carry):
        r, y = carry
        buffers = jax.experimental.io_callback(read_expert, shapes, position, order, count, r, ahead, ordered=False)
        return r + 1, y + kernel(x, chunk_slot_ids(token_rank, r, 1), weights, buffers, out_dtype=jnp.float32)

    _, y = jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.int32(0), jnp.zeros(x.shape, jnp.float32)))
    return y


def _row_written(rows, expert, row):
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, row, 0), rows, expert)


def write_row():
    """A function (rows, expert, row) -> rows with `expert` (leading axis 1, host memory) written into `row`,
    the rows' buffers donated (in place: no copy of the other rows)."""
    host = sharding_for(PINNED_HOST)
    # On a GPU the rows are host memory: written there, never brought to the device.
    return jax.jit(computed_on_host(_row_written), donate_argnums=0, in_shardings=(host, host, None),
                   out_shardings=host)


AHEAD = DEMAND[0] + 1  # reads ahead rank (AHEAD, layer position) in the reader's queues: after every demand read

# Experts per layer a step keeps for admission (its best read by the policy), held until the step ends.
STAGED_PER_LAYER = 1


def host_budget_gb_holding(rows: int, layer_expert_bytes: int, read_ahead_bytes: int = 0) -> float:
    """The host_budget_gb whose tier holds `rows` host rows per offloaded layer with the staged experts beside them
    (`layer_expert_bytes`: one expert of every offloaded layer together) and the experts read ahead
    (`read_ahead_bytes`: that many of one layer), and half an expert of each layer more, so that rounding never
    leaves one out."""
    return ((rows + STAGED_PER_LAYER + 0.5) * layer_expert_bytes + read_ahead_bytes) / 1e9


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def release_large_buffers_at_free() -> None:
    """glibc: serve every allocation of 1 MiB or more by mmap, so that it goes back to the system when freed. Its
    default threshold grows to 32 MiB after the first large free, and the reader threads' expert buffers (tens
    of MB each, one malloc arena per thread) then stay in the arenas: a decode of a 30 GB model kept 8.7 GB
    resident after three tokens, 3.6 GB with this. No effect where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


class HostTier:
    """The host rows of the offloaded layers, what is in them, and the reads of a step (see the module
    docstring). `moe_layers`: the decoder layer index of each offloaded layer; `like`: each one's experts as the
    model holds them (their leaves' shapes past the expert axis, dtypes, formats); `reader`: an expert reader of
    the checkpoint (jmoe.checkpoint.expert_reader_orbax.open_expert_reader), closed by `close`; `queue_depth`: the
    reads a step keeps in flight per layer; `read_ahead`: the experts of the next layer read ahead (0: none)."""

    def __init__(self, reader, moe_layers: tuple[int, ...], like: list[ExpertWeights], rows: int,
                 num_experts: int, queue_depth: int, read_ahead: int = 0):
        self.reader, self.moe_layers, self.like, self.rows = reader, moe_layers, like, rows
        self.queue_depth, self.read_ahead = queue_depth, read_ahead
        release_large_buffers_at_free()
        # The reads a step holds at most: each layer's staged expert, the next layer's read ahead, and the reads in
        # flight; the reader keeps their buffers for reuse.
        reader.retain_buffers(len(moe_layers) * STAGED_PER_LAYER + read_ahead + queue_depth)
        self.row_of_expert = np.full((len(moe_layers), num_experts), -1, np.int32)
        self.expert_in_row = np.full((len(moe_layers), rows), -1, np.int32)
        self.disk_reads = np.zeros(len(moe_layers), np.int64)  # experts steps needed from disk
        self.read_ahead_reads = np.zeros(len(moe_layers), np.int64)  # reads read_ahead submitted
        self.read_ahead_used = np.zeros(len(moe_layers), np.int64)  # of disk_reads, found read ahead
        self.wait_seconds = 0.0  # steps' time waiting for the disk
        self._step_reads: dict[int, tuple[int, ExpertWeights]] = {}  # position -> the read kept for admission
        self._priority: np.ndarray | None = None  # the policy's ranking at the last admissions [Lo, E]
        # read ahead, not yet used: (future, its rank in the reader's queues)
        self._ahead: dict[tuple[int, int], tuple[concurrent.futures.Future, ReadPriority]] = {}
        self._in_flight: dict[tuple[int, int], concurrent.futures.Future] = {}  # a step's reads, not yet returned
        self._lock = threading.Lock()

    # ---- the initial rows ------------------------------------------------------------------------------
    def initial_rows(self) -> tuple:
        """Each layer's rows filled with its first H experts, read from the checkpoint (all reads in flight at
        once), in pinned host memory; the tables and counts start over (a new policy, `Model.set_policy`)."""
        self.row_of_expert[:] = -1
        for counts in (self.disk_reads, self.read_ahead_reads, self.read_ahead_used):
            counts[:] = 0
        self.wait_seconds = 0.0
        self._step_reads, self._priority = {}, None
        with self._lock:
            self._drop_ahead(lambda key: False)
        self._in_flight.clear()
        tiers = []
        for position, layer in enumerate(self.moe_layers):
            experts = list(range(self.rows))
            futures = [self.reader.submit(layer, e) for e in experts]
            reads = [expert_weights_from(f.result(), self.like[position]) for f in futures]
            tier = jax.tree.map(lambda *a: np.concatenate(a), *reads)
            tiers.append(jax.device_put(tier, sharding_for(PINNED_HOST)))
            self.row_of_expert[position, experts] = np.arange(self.rows)
            self.expert_in_row[position] = experts
        return tuple(tiers)

    # ---- inside a step (on the callback's thread) -------------------------------------------------------
    def read_expert(self, position: int, order, count, r, ahead):
        """The leaves of expert order[r] of offloaded layer `position` (order[:count]: the experts the layer reads
        from disk this step), read from disk; first the reads of order[r:r + k] not yet in flight are submitted,
        and in round 0 the reads ahead of `ahead` (experts of the next offloaded layer, -1 none)."""
        position, order, count, r = int(position), np.asarray(order), int(count), int(r)
        layer = self.moe_layers[position]
        with self._lock:
            for e in map(int, order[r:min(count, r + self.queue_depth)]):
                if (position, e) not in self._in_flight:
                    early = self._ahead.pop((position, e), None)
                    self.read_ahead_used[position] += early is not None
                    if early is not None:
                        self.reader.hurry(early[1])
                    self._in_flight[position, e] = early[0] if early else self.reader.submit(layer, e)
            if r == 0:
                needed = {(position, int(e)) for e in order[:count]}
                self._drop_ahead(lambda key: key[0] > position or key in needed)
                if position + 1 < len(self.moe_layers):
                    self._submit_ahead(position + 1, np.asarray(ahead), len(ahead))
            expert = int(order[r])
            future = self._in_flight.pop((position, expert))
        waited = time.perf_counter()
        read = future.result()
        waited = time.perf_counter() - waited
        weights = expert_weights_from(read, self.like[position])
        with self._lock:
            self.disk_reads[position] += 1
            self.wait_seconds += waited
            kept = self._step_reads.get(position)
            if kept is None or self._rank(position, expert) > self._rank(position, kept[0]):
                self._step_reads[position] = (expert, weights)
        return weights.stacked()

    # ---- between steps ----------------------------------------------------------------------------------
    def admissions(self, priority: np.ndarray, on_device: np.ndarray) -> list[tuple[int, int, int, ExpertWeights]]:
        """(layer position, row, expert, weights) for each expert read during the last step, or read ahead and
        done, that the policy values above a row's expert (`priority` [Lo, E], higher keeps); rows whose expert
        sits in a device slot (`on_device` bool [Lo, E]) are kept. Updates the tables; the caller writes the
        rows."""
        with self._lock:
            kept, self._step_reads, self._priority = self._step_reads, {}, priority
            done = {key: f for key, (f, _) in self._ahead.items() if f.done() and f.exception() is None}
        reads = {(position, expert): weights for position, (expert, weights) in kept.items()}
        for (position, expert), future in done.items():
            reads.setdefault((position, expert), expert_weights_from(future.result(), self.like[position]))
        out = []
        for (position, expert), weights in sorted(reads.items(), key=lambda kv: -priority[kv[0][0], kv[0][1]]):
            if self.row_of_expert[position, expert] >= 0:
                continue
            held = self.expert_in_row[position]
            free = np.flatnonzero(held < 0)
            if free.size:
                row = int(free[0])
            else:
                evictable = np.flatnonzero(~on_device[position, held])
                if not evictable.size:
                    continue
                row = int(evictable[np.argmin(priority[position, held[evictable]])])
                if priority[position, held[row]] >= priority[position, expert]:
                    continue
                self.row_of_expert[position, held[row]] = -1
            self.row_of_expert[position, expert] = row
            self.expert_in_row[position, row] = expert
            out.append((position, row, expert, weights))
        with self._lock:
            for position, _, expert, _ in out:
                self._ahead.pop((position, expert), None)
        return out

    def _rank(self, position: int, expert: int) -> float:
        return -np.inf if self._priority is None else self._priority[position, expert]

    def read_ahead_first_layer(self, scores: np.ndarray) -> None:
        """Between steps: the reads ahead of the first offloaded layer's `read_ahead` best-`scores` experts ([E], the
        predictor's for the next token) in no row; the reads ahead of the last step not admitted are dropped."""
        with self._lock:
            self._drop_ahead(lambda key: False)
            self._submit_ahead(0, np.argsort(-scores, kind="stable"), self.read_ahead)

    def _submit_ahead(self, position: int, experts: np.ndarray, count: int) -> None:
        """Read ahead the first `count` of `experts` (-1: none) of layer `position` that are in no row and not read
        ahead already (the caller holds the lock; no step reads this layer yet)."""
        submitted = 0
        for expert in map(int, experts):
            if submitted == count:
                return
            if expert < 0 or self.row_of_expert[position, expert] >= 0 or (position, expert) in self._ahead:
                continue
            priority = ReadPriority((AHEAD, position))
            self._ahead[position, expert] = (self.reader.submit(self.moe_layers[position], expert, priority), priority)
            self.read_ahead_reads[position] += 1
            submitted += 1

    def _drop_ahead(self, keep) -> None:
        """Drop the reads ahead whose (position, expert) `keep` refuses (the caller holds the lock)."""
        for key in [k for k in self._ahead if not keep(k)]:
            self._ahead.pop(key)[0].cancel()  # a read already running finishes; its result is let go

    def close(self) -> None:
        with self._lock:
            self._drop_ahead(lambda key: False)
        for future in self._in_flight.values():
            future.cancel()
        self._in_flight.clear()
        self.reader.close()

