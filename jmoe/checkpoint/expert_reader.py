"""Read one routed expert's weights from a Hugging Face safetensors checkpoint, on demand (issue #31: experts
kept on disk rather than in host RAM).

Why byte ranges: one expert is a small share of a file, either whole per-expert tensors (Mixtral-style
`experts.{e}.w1.weight`, with a float8 weight's `weight_scale_inv`) or its slice of a stacked tensor whose
first axis is the expert (GPT-OSS's `gate_up_proj`, MXFP4 blocks and scales). The reader works those ranges
out once from the headers and reads only them, with `os.pread` on file descriptors opened once.

Why threads: an NVMe drive reaches its bandwidth only with many reads in flight, so `submit` queues each
expert on a pool of threads and returns a future.

Why the checks: the files are read long after loading started, and a file that changed underneath would
otherwise give other numbers. So each read compares the file's (size, mtime) with those at construction,
before and after reading; a read that ends early is an error; each expert's bytes carry the CRC-32 of its first
read, compared on every later one (a rewrite that kept size and mtime); an OSError is retried, then reported.
Every fault is a CheckpointError naming the file and tensors, never weights.

The weights come out as `jmoe.load` stores them, one expert without the expert axis: loading's orientation
(`oriented`), cast, and quantizer (`quantize`, whose scales never span experts, so one expert quantized alone
equals its slice of the quantized stack).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import weakref
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jmoe.arguments import whole_number
from jmoe.checkpoint import fp8, mxfp4
from jmoe.checkpoint.checksum import crc32
from jmoe.checkpoint.hf_layout import TensorTarget, expected_tensors
from jmoe.checkpoint.loading import param_pieces, params_as_read, put_oriented
from jmoe.checkpoint.read_buffers import BufferPool, open_for_reads, piece_threads, read_range
from jmoe.checkpoint.read_order import DEMAND, PriorityPool, ReadPriority
from jmoe.checkpoint.safetensors_files import STORED_DTYPES, TensorInfo, checkpoint_files
from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError, InputError
from jmoe.kernels import FORMATS, quantize

THREAD_PREFIX = "jmoe-expert-reader"
QUANTIZED_WEIGHTS = ("w_gate_up", "w_down")  # the expert weights loading quantizes (stored_params)
RESTART = "the checkpoint must not change while a model reads it: restore it and load the model again"


@dataclasses.dataclass(frozen=True)
class _Run:
    """One contiguous byte range of one file, read in one go: an expert's tensors that lie next to each other."""
    file: Path
    start: int
    end: int
    tensors: tuple[str, ...]

    def describe(self) -> str:
        return f"tensor(s) {', '.join(repr(t) for t in self.tensors)} (bytes {self.start}..{self.end})"


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """An array stored in the checkpoint (a weight, or a quantized weight's codes or scales): its bytes at
    `offset` in run `run` of the expert's runs."""
    run: int
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def array(self, buffers: list[np.ndarray]) -> np.ndarray:
        count = int(np.prod(self.shape, dtype=np.int64))
        return np.frombuffer(buffers[self.run], STORED_DTYPES[self.dtype], count, self.offset).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One checkpoint tensor's share of one expert parameter: its leaves, how they decode (as read_tensor
    decodes them), and where the oriented result goes in the one-expert parameter."""
    param: str
    index: tuple
    target: TensorTarget
    leaves: tuple[_Leaf, ...]
    fp8_block: tuple[int, int] | None
    mxfp4: bool

    def decoded(self, buffers: list[np.ndarray]) -> np.ndarray:
        arrays = [leaf.array(buffers) for leaf in self.leaves]
        if self.fp8_block is not None:
            return fp8.dequantize(arrays[0], arrays[1], self.fp8_block)
        if self.mxfp4:  # mxfp4.dequantize takes a stack: this expert as a stack of one
            return mxfp4.dequantize(arrays[0][None], arrays[1][None])[0]
        return arrays[0]


@dataclasses.dataclass(frozen=True)
class _ExpertPlan:
    """Everything needed to read one expert: the byte runs, the pieces, and the parameters' shapes."""
    runs: tuple[_Run, ...]
    pieces: tuple[_Piece, ...]
    params: dict[str, tuple[tuple[int, ...], np.dtype]]  # name -> (one expert's shape, dtype)


def _expert_slice(info: TensorInfo, expert: int) -> TensorInfo:
    """The bytes of `expert` in a tensor whose first axis is the expert: contiguous, one E-th of the tensor."""
    stride = (info.end - info.start) // info.shape[0]
    start = info.start + expert * stride
    return TensorInfo(info.file, info.dtype, info.shape[1:], start, start + stride)


class _Source(NamedTuple):
    """A checkpoint tensor that fills (part of) one expert's parameter."""
    param: str  # the experts module's parameter name
    index: tuple  # where it goes in the one-expert parameter
    target: TensorTarget
    info: TensorInfo  # the whole tensor; `stacked`: every expert's, expert axis first
    name: str
    stacked: bool


def _sources_by_expert(cfg: ModelConfig, pieces: dict[str, list]) -> list[list[_Source]]:
    """Per expert of one layer, the tensors that fill it, from `pieces` {param name: [(target, info, tensor
    name)]} (one pass: a layer of a large model has thousands of per-expert tensors)."""
    sources: list[list[_Source]] = [[] for _ in range(cfg.num_experts)]
    for param, entries in pieces.items():
        for target, info, name in entries:
            if target.index and isinstance(target.index[0], int):  # a per-expert tensor: read whole
                sources[target.index[0]].append(_Source(param, target.index[1:], target, info, name, False))
            elif target.index == () and info.shape[0] == cfg.num_experts and not target.transpose:
                for expert_sources in sources:  # a stacked tensor: each expert reads its slice
                    expert_sources.append(_Source(param, (), target, info, name, True))
            else:
                raise AssertionError(f"{name}: a layout the expert reader does not know ({target})")
    return sources


def _stored_parts(source: _Source, expert: int) -> list[tuple[str, TensorInfo]]:
    """(tensor name, where its bytes are) of each array the checkpoint stores for `source`'s share of
    `expert`: a float8 weight and its block scales, or MXFP4 blocks and scales (attach_scales, attach_mxfp4)."""
    name, info = source.name, source.info
    if info.mx_blocks is not None:  # attach_mxfp4 named the pair's entry after the weight
        parts = [(name + mxfp4.BLOCKS_SUFFIX, info.mx_blocks), (name + mxfp4.SCALES_SUFFIX, info.mx_scales)]
    else:
        parts = [(name, info)] + ([(name + fp8.SCALE_SUFFIX, info.scale_inv)] if info.scale_inv is not None else [])
    if not source.stacked:
        return parts
    if info.scale_inv is not None:  # block scales span rows, not experts: attach_scales allows 2-D weights only
        raise AssertionError(f"{name}: a stacked float8 tensor with block scales; the reader cannot slice it")
    return [(part_name, _expert_slice(part, expert)) for part_name, part in parts]


def _merged_runs(parts: list[tuple[str, TensorInfo]]) -> tuple[list[_Run], list[tuple[int, int]]]:
    """Runs covering `parts` (adjacent ranges of a file merged, nothing else read) and, per part in order,
    (run index, offset in the run)."""
    order = sorted(range(len(parts)), key=lambda i: (str(parts[i][1].file), parts[i][1].start))
    runs: list[_Run] = []
    where: dict[int, tuple[int, int]] = {}
    for i in order:
        name, info = parts[i]
        last = runs[-1] if runs else None
        if last is not None and last.file == info.file and last.end == info.start:
            runs[-1] = _Run(last.file, last.start, info.end, last.tensors + (name,))
        else:
            runs.append(_Run(info.file, info.start, info.end, (name,)))
        where[i] = (len(runs) - 1, info.start - runs[-1].start)
    return runs, [where[i] for i in range(len(parts))]


def _expert_plan(expert: int, sources: list[_Source], shapes: dict) -> _ExpertPlan:
    """How to read `expert` from its `sources`; `shapes` {name: (one expert's shape, dtype)} of its parameters."""
    parts = [(n, part) for n, source in enumerate(sources) for part in _stored_parts(source, expert)]
    runs, where = _merged_runs([part for _, part in parts])
    leaves: list[list[_Leaf]] = [[] for _ in sources]
    for (owner, (_, info)), (run, offset) in zip(parts, where):
        leaves[owner].append(_Leaf(run, offset, info.dtype, info.shape))
    pieces = tuple(_Piece(s.param, s.index, s.target, tuple(leaves[n]),
                          s.info.block if s.info.scale_inv is not None else None, s.info.mx_blocks is not None)
                   for n, s in enumerate(sources))
    return _ExpertPlan(tuple(runs), pieces, shapes)


def _layer_plans(cfg: ModelConfig, params: dict[str, object], pieces: dict[str, list]) -> list[_ExpertPlan]:
    """The plan of each expert of one layer; `params` {name: stacked shape struct} of its experts module."""
    shapes = {name: (tuple(struct.shape[1:]), np.dtype(struct.dtype)) for name, struct in params.items()}
    return [_expert_plan(e, sources, shapes) for e, sources in enumerate(_sources_by_expert(cfg, pieces))]


def _layer_expert_pieces(model_dir: Path, cfg: ModelConfig, as_read: dict) -> dict[int, tuple[dict, dict]]:
    """MoE layer index -> ({param name: stacked shape struct}, {param name: [(target, info, tensor name)]}) of
    its routed experts module, from the headers alone (param_pieces checks them as loading does)."""
    pieces = param_pieces(model_dir, cfg, as_read, check_data=False)
    names = _tensor_names(cfg, pieces)
    layers: dict[int, tuple[dict, dict]] = {}
    for path, struct in as_read.items():
        if path[0] == "layers" and path[-2] == "experts":  # ("layers", i, "mlp", "experts", name): hf_layout
            params, by_param = layers.setdefault(path[1], ({}, {}))
            params[path[-1]] = struct
            by_param[path[-1]] = [(target, info, name) for (target, info), name in zip(pieces[path], names[path])]
    return layers


def _tensor_names(cfg: ModelConfig, pieces: dict) -> dict[tuple, list[str]]:
    """Per parameter path, the checkpoint tensor name of each of its pieces, for error messages (param_pieces
    keeps the targets and files, in the name table's order)."""
    named: dict[tuple, list[tuple[str, TensorTarget]]] = {}
    for name, target in expected_tensors(cfg).items():
        named.setdefault(target.param, []).append((name, target))
    for path, path_pieces in pieces.items():
        if [target for target, _ in path_pieces] != [target for _, target in named[path]]:
            raise AssertionError(f"{path}: param_pieces and expected_tensors disagree on the tensors' order")
    return {path: [name for name, _ in entries] for path, entries in named.items()}


def expert_threads(threads: int, name: str) -> PriorityPool:
    """The threads a reader reads experts on, demand reads first: read-ahead may hold `threads` of them (each
    waits on its pieces), and threads // 2 more wait for demand reads only, which then queue their pieces at once."""
    return PriorityPool(threads + threads // 2, name, reserved=threads // 2)


def close_descriptors(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class PooledReader:
    """What the expert readers share: reads of one expert run on a pool of threads (`submit`), `read` waits for
    one, `close` stops the threads and releases the files and buffers. A subclass sets `_lock`, `_closed`, `_pool`,
    `_pieces` (read_buffers.piece_threads) and `_buffers` (a read_buffers.BufferPool the reads fill) when it is
    built, and gives `_key` (checked (layer, expert)), `_read_expert` (one read, on a pool thread) and
    `_release`."""

    def submit(self, layer: int, expert: int, priority: ReadPriority | None = None) -> concurrent.futures.Future:
        """A future of `read(layer, expert)`, read on the reader's threads, in the order of `priority`
        (jmoe.checkpoint.read_order; default: a demand read, before any read ahead)."""
        key = self._key(layer, expert)
        with self._lock:  # close() cannot shut the pool between this check and the submit
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} of {self.model_dir} is closed; experts cannot be read "
                                   f"after close(): create a new reader")
            return self._pool.submit(self._read_expert, key, priority=priority or ReadPriority())

    def hurry(self, priority: ReadPriority) -> None:
        """Make the reads submitted with `priority` demand reads (a step now waits for one), queued pieces too."""
        priority.rank = DEMAND
        self._pool.wake()
        self._pieces.wake()

    def read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Expert `expert` of decoder layer `layer` as jmoe.load holds it, without the expert axis:
        {"w_gate_up": [d, 2f], "w_down": [f, d], biases if the model has them, "..._scale" for quantized
        formats}. Raises CheckpointError if a file changed, its bytes are not the expected ones, or a read fails."""
        return self.submit(layer, expert).result()

    def retain_buffers(self, reads: int) -> None:
        """Keep the buffers of up to `reads` reads for reuse once they are let go (default: the reader's threads):
        a user that holds more reads alive at once, as the disk tier's steps do, reuses them instead of faulting
        fresh pages in for each."""
        self._buffers.retain(reads)

    def close(self) -> None:
        """Cancel queued reads (their futures raise CancelledError), wait for running ones, stop the threads and
        release the files. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pieces.shutdown(wait=True)
        self._buffers.clear()
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ExpertReader(PooledReader):
    """Routed experts of a Hugging Face safetensors checkpoint, read one at a time by byte range.

    `cfg` is the config loading uses (its `expert_dtype` decides the stored format: pass the config
    `jmoe.plan.headers.read_headers` returns, which applies jmoe.load's expert_dtype rules); `dtype` the
    parameter dtype (default `cfg.dtype`), as for `load_model`. `threads`: reads in flight. `retries`: further
    attempts after an OSError from a read. `direct`: read past the page cache (O_DIRECT, jmoe.checkpoint.read_buffers).
    Use as a context manager, or call `close()`.
    """

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, *, dtype=None, threads: int = 8, retries: int = 2,
                 direct: bool = False):
        self.model_dir, self.cfg = Path(model_dir), cfg
        self.direct = direct
        self._threads = whole_number("threads", threads, 1, "expert reads in flight")
        self._retries = whole_number("retries", retries, 0, "further attempts after a failed read")
        self._dtype = np.dtype(jnp.dtype(dtype or cfg.dtype))
        self._fds: dict[Path, int] = {}
        # Closes the files once: at close(), a failed construction, or when a reader nobody closed is collected.
        self._close_files = weakref.finalize(self, close_descriptors, self._fds)
        self._identity: dict[Path, tuple[int, int]] = {}  # (size, mtime_ns) when opened
        self._crcs: dict[tuple[int, int], int] = {}  # CRC-32 of each expert's bytes at its first read
        self._buffers = BufferPool(keep=self._threads)
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._open_files()
            layers = _layer_expert_pieces(self.model_dir, cfg, params_as_read(cfg, self._dtype))
            self._check_headers_came_from_open_files()
            self._plans = {(layer, e): plan for layer, (params, pieces) in sorted(layers.items())
                           for e, plan in enumerate(_layer_plans(cfg, params, pieces))}
            self._check_ranges_inside_files()
        except BaseException:
            self._close_files()
            raise
        self.layers: tuple[int, ...] = tuple(sorted(layers))  # the MoE layers' decoder layer indices
        self.num_experts: int = cfg.num_experts
        self._pool = expert_threads(self._threads, THREAD_PREFIX)
        self._pieces = piece_threads(self._threads)

    # ---- public (submit, read, close: PooledReader) ----

    def checkpoint_bytes(self, layer: int, expert: int) -> int:
        """Bytes one read of this expert takes from the checkpoint files."""
        return sum(run.end - run.start for run in self._plans[self._key(layer, expert)].runs)

    def _release(self) -> None:
        self._close_files()

    # ---- construction ----

    def _open_files(self) -> None:
        """Open every checkpoint file once, recording what it was (compared before and after every read)."""
        for path in checkpoint_files(self.model_dir):
            self._fds[path] = open_for_reads(path, self.direct)
            st = os.fstat(self._fds[path])
            self._identity[path] = (st.st_size, st.st_mtime_ns)

    def _check_headers_came_from_open_files(self) -> None:
        """The headers were read by path: the path must still name the file held open, unchanged."""
        for path, fd in self._fds.items():
            held, named = os.fstat(fd), os.stat(path)
            if ((held.st_dev, held.st_ino, held.st_size, held.st_mtime_ns) !=
                    (named.st_dev, named.st_ino, named.st_size, named.st_mtime_ns)
                    or (held.st_size, held.st_mtime_ns) != self._identity[path]):
                raise CheckpointError(f"{path}: the file changed while its header was read; {RESTART}")

    def _check_ranges_inside_files(self) -> None:
        for plan in self._plans.values():
            for run in plan.runs:
                size = self._identity[run.file][0]
                if run.end > size:
                    raise CheckpointError(f"{run.file}: {run.describe()} ends at byte {run.end}, but the file has "
                                          f"{size} bytes; the file is truncated: download or export it again")

    def _key(self, layer, expert) -> tuple[int, int]:
        key = (layer, expert)
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in key) or key not in self._plans:
            raise InputError(f"layer {layer!r} expert {expert!r} is not a routed expert of {self.model_dir}: the MoE "
                             f"layers are {list(self.layers)}, experts 0..{self.num_experts - 1}")
        return int(layer), int(expert)

    # ---- one read, on a pool thread ----

    def _read_expert(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        plan = self._plans[key]
        buffers = [self._read_run(key, run) for run in plan.runs]
        self._check_crc(key, plan, buffers)
        return self._stored(key, plan, buffers)

    def _read_run(self, key: tuple[int, int], run: _Run) -> np.ndarray:
        """The run's bytes (uint8, in a buffer of the pool), checked against the file as opened; an OSError is
        retried `retries` times."""
        attempts = self._retries + 1
        for _ in range(attempts):
            try:
                self._check_unchanged(key, run, "before")
                data = read_range(self._fds[run.file], run.start, run.end - run.start, self._buffers, self._pieces,
                                  lambda offset: self._short_read(key, run, offset), self.direct)
                self._check_unchanged(key, run, "after")
                return data
            except OSError as e:
                error = e
        raise CheckpointError(f"{run.file}: reading {run.describe()} for {self._expert(key)} failed {attempts} "
                              f"times ({attempts} attempts: 1 + retries={self._retries}); last error: {error}. Check "
                              f"the disk and the file (a failing drive, a network mount that went away), then load "
                              f"the model again, or pass a larger `retries` for a flaky mount") from error

    def _check_unchanged(self, key: tuple[int, int], run: _Run, when: str) -> None:
        st = os.fstat(self._fds[run.file])
        (size, mtime), found = self._identity[run.file], (st.st_size, st.st_mtime_ns)
        if found != (size, mtime):
            raise CheckpointError(f"{run.file}: the file changed while the model runs: {size} bytes with mtime "
                                  f"{mtime} ns when opened, {found[0]} bytes with mtime {found[1]} ns {when} reading "
                                  f"{run.describe()} for {self._expert(key)}; {RESTART}")

    def _short_read(self, key: tuple[int, int], run: _Run, offset: int) -> CheckpointError:
        return CheckpointError(f"{run.file}: the file ends at byte {offset} inside {run.describe()} for "
                               f"{self._expert(key)}; it was {self._identity[run.file][0]} bytes when opened, so it "
                               f"was truncated while the model runs; {RESTART}")

    def _check_crc(self, key: tuple[int, int], plan: _ExpertPlan, buffers: list[np.ndarray]) -> None:
        """The expert's bytes must be those of its first read (a rewrite can keep the size and mtime)."""
        crc = 0
        for buffer in buffers:
            crc = crc32(buffer, crc)
        with self._lock:
            first = self._crcs.setdefault(key, crc)
        if crc != first:
            files = ", ".join(dict.fromkeys(str(run.file) for run in plan.runs))
            tensors = "; ".join(run.describe() for run in plan.runs)
            raise CheckpointError(f"{files}: the bytes of {self._expert(key)} ({tensors}) have CRC-32 {crc:#010x}, "
                                  f"expected {first:#010x} as at their first read: the file was rewritten while the "
                                  f"model runs (its size and mtime kept); {RESTART}")

    def _stored(self, key: tuple[int, int], plan: _ExpertPlan, buffers: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The expert's parameters as loading stores them: assembled (assemble_param's orientation and cast),
        then quantized (stored_params) for a quantized expert format."""
        out = {name: self._buffers.lease(int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)
               for name, (shape, dtype) in plan.params.items()}
        for piece in plan.pieces:
            param = out[piece.param]
            put_oriented(param[piece.index], piece.target, piece.decoded(buffers))
        if self.cfg.expert_dtype not in FORMATS:
            return out
        for name in QUANTIZED_WEIGHTS:
            try:
                stored = quantize(out[name], self.cfg.expert_dtype, self.cfg.expert_group)
            except ValueError as e:  # NaN or inf weights: loading refuses them the same way
                raise CheckpointError(f"{plan.runs[0].file}: {self._expert(key)} {name}: {e}; the weights are "
                                      f"broken: download or export the checkpoint again") from e
            out[name], out[f"{name}_scale"] = stored.values, stored.scales
        return out

    def _expert(self, key: tuple[int, int]) -> str:
        return f"layer {key[0]} expert {key[1]}"
