"""Read one routed expert's weights from a jmoe Orbax checkpoint, on demand (issue #31: experts kept on disk rather
than in host RAM): the Orbax counterpart of jmoe.checkpoint.expert_reader's ExpertReader, with the same API.

What is read: the converter (jmoe.checkpoint.convert) stores each routed experts parameter as a zarr3 array under
OCDBT (Orbax's defaults, uncompressed) chunked one expert per chunk along its expert axis, so one expert of one
parameter is one OCDBT value: a byte range of one data file (or, under 1 KiB, a value inline in a B+tree leaf
node). Each chunk is zarr3's shard of one inner chunk: the raw little-endian values, then the shard index
(the inner chunk's offset and length, and a CRC-32C of the index).

Where the bytes are: at construction the reader opens each experts parameter's array with TensorStore (zarr3 over
OCDBT over the files) to check its dtype, shape and codecs, and walks the OCDBT B+tree (tensorstore.ocdbt.dump)
once, finding for each expert chunk its data file, offset and length (or its inline bytes), and the B+tree node
files on the way to it. That gives `checkpoint_bytes` exactly, the files each read touches, and a check, before
any read, that every chunk lies inside its file and has its shard's length. A checkpoint whose experts are not
stored so (converted before this layout, or with other codecs) is refused: each read would read every expert of
the layer, or would need decoding.

How a read reads: each chunk by byte range (pread) into a buffer from the reader's pool
(jmoe.checkpoint.read_buffers: reused, where TensorStore's reads filled two fresh buffers per chunk, and the page
faults and zeroing of those took more CPU than the copies), its shard index checked. The data is never cached (a
read always reads the files, so its CRC-32 checks what is on disk now).

Why the checks: as ExpertReader's. Each read compares the (size, mtime_ns) of the files it touches (its data
files, the B+tree node files on the way, the OCDBT manifest) with those at construction, before and after reading;
the expert's bytes as read must have the CRC-32 the converter recorded for that expert (the manifest's
"expert_crc32"): stronger than ExpertReader's CRC of the first read, since the first read is checked too; a read
error is retried, then reported. Every fault is a CheckpointError naming the checkpoint's file, the parameter and
the expert. A checkpoint converted before per-expert CRC-32s were recorded is refused (so is its layout).

The weights come out as `restore_model` holds them, one expert without the expert axis: the stored values cast to
the parameter dtype (`dtype`, default the dtype it was converted to) by TensorStore, as Orbax's restore casts them;
quantized experts (values + `_scale`) as stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import weakref
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from jmoe.arguments import whole_number
from jmoe.checkpoint.checksum import crc32
from jmoe.checkpoint.expert_reader import (RESTART, ExpertReader, PooledReader, close_descriptors,
                                          expert_threads)
from jmoe.checkpoint.read_buffers import BufferPool, open_for_reads, piece_threads, read_range
from jmoe.checkpoint.read_order import PriorityPool
from jmoe.checkpoint.orbax_store import (EXPERT_CRC32, PARAMS_DIR, check_params, converted_expert_dtype,
                                         is_expert_param, is_orbax_checkpoint, read_manifest, stored_dtype)
from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError, InputError
from jmoe.model.params import abstract_params, param_key

THREAD_PREFIX = "jmoe-orbax-expert-reader"
TREE_METADATA = "_METADATA"  # Orbax's tree metadata, in the directory of the saved pytree (params/<item>/)
OCDBT_MANIFEST = "manifest.ocdbt"
OCDBT_CACHE_BYTES = 100_000_000  # the OCDBT manifest and B+tree nodes, read once (Orbax's own limit for them)
SHARD_INDEX_BYTES = 20  # zarr3's shard index after its one inner chunk: offset, length (u64 each), CRC-32C
RECONVERT = "convert the checkpoint again with `python -m jmoe.convert HF_DIR OUT` (this version of jmoe)"


@dataclasses.dataclass(frozen=True)
class _Value:
    """Where one OCDBT value is: `file`, bytes [offset, offset + length); `file` None for a value stored inline
    in a B+tree leaf node: `inline`, its bytes as the node held them at construction (the node file's identity is
    checked at every read, as the data files')."""
    file: Path | None
    offset: int
    length: int
    inline: bytes | None = None


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One stored chunk of one expert: its OCDBT key, where its bytes are, and the B+tree node files a lookup
    of the key reads."""
    key: bytes
    value: _Value
    nodes: tuple[Path, ...]

    def describe(self, state_dir: Path) -> str:
        where = ("inline in a B+tree node" if self.value.file is None else
                 f"{self.value.file.relative_to(state_dir)} bytes {self.value.offset}.."
                 f"{self.value.offset + self.value.length}")
        return f"chunk {self.key.decode(errors='replace')!r} ({where})"


@dataclasses.dataclass(frozen=True)
class _Param:
    """One routed experts parameter of one layer: its stored array and what one expert of it is."""
    name: str  # the experts module's parameter name, e.g. "w_gate_up"
    key: str  # its manifest / Orbax name, e.g. "layers.3.mlp.experts.w_gate_up"
    stored: np.dtype  # as the converter wrote it
    dtype: np.dtype  # as restore_model holds it
    shape: tuple[int, ...]  # one expert's
    crcs: tuple[int, ...]  # the converter's CRC-32 of each expert's stored bytes

    @property
    def nbytes(self) -> int:
        """One expert's stored values, in bytes (its chunk adds zarr3's shard index)."""
        return int(np.prod(self.shape)) * self.stored.itemsize


def _parse_location(state_dir: Path, location: str, kind: str) -> _Value:
    """An OCDBT dump location "<kind>:<base path>:<relative path>:<offset>:<length>" -> where it is."""
    if not location.startswith(kind + ":"):
        raise ValueError(f"not a {kind} location: {location!r}")
    head, offset, length = location[len(kind) + 1:].rsplit(":", 2)
    base, relative = head.split(":", 1)
    return _Value(state_dir / base / relative, int(offset), int(length))


def _ocdbt_chunks(state_dir: Path, wanted: set[str]) -> dict[str, list[tuple[tuple[int, ...], _Chunk]]]:
    """For each array name in `wanted`: (chunk grid position, chunk) of every chunk the OCDBT database at
    `state_dir` stores for it ("<name>/c/<i>/<j>/...", zarr3's default chunk keys), from its latest version's
    B+tree. A child node's keys continue its parent's prefix plus the entry's subtree_common_prefix."""
    base = ts.KvStore.open(_files_under(state_dir)).result()
    manifest = ts.ocdbt.dump(base).result()
    latest = max(manifest["versions"], key=lambda v: v["generation_number"])
    found: dict[str, list] = {name: [] for name in wanted}
    if "location" not in latest["root"]:  # an empty database
        return found

    def walk(location: str, prefix: bytes, nodes: tuple[Path, ...]) -> None:
        node_value = _parse_location(state_dir, location, "btreenode")
        nodes = nodes + (node_value.file,)
        node = ts.ocdbt.dump(base, location).result()
        for entry in node["entries"]:
            if node.get("height", 0) > 0:  # an interior node: its entries lead to child nodes
                walk(entry["location"], prefix + entry.get("subtree_common_prefix", b""), nodes)
                continue
            key = prefix + entry["key"]
            name, sep, grid = key.decode(errors="replace").partition("/c/")
            if not sep or name not in wanted:
                continue
            if "indirect_value" in entry:
                value = _parse_location(state_dir, entry["indirect_value"], "value")
            else:
                value = _Value(None, 0, len(entry["inline_value"]), entry["inline_value"])
            found[name].append((tuple(int(i) for i in grid.split("/")), _Chunk(key, value, nodes)))

    walk(latest["root"]["location"], b"", ())
    return found


def _files_under(directory: Path) -> dict:
    """TensorStore's file kvstore spec of `directory` (a spec, not a file:// URL: any character in a path)."""
    return {"driver": "file", "path": f"{directory}/"}


def _pytree_dir(params_dir: Path) -> Path:
    """The directory Orbax saved the parameter tree in (params/<item>/, with its tree metadata and the OCDBT
    manifest), checked to be zarr3 over OCDBT: the layout the reader knows."""
    candidates = sorted(p for p in params_dir.iterdir() if (p / TREE_METADATA).is_file()) if params_dir.is_dir() else []
    if len(candidates) != 1:
        raise CheckpointError(f"{params_dir}: expected one saved parameter tree (a directory with {TREE_METADATA}), "
                              f"found {[p.name for p in candidates]}; the checkpoint is incomplete: {RECONVERT}")
    state_dir = candidates[0]
    try:
        metadata = json.loads((state_dir / TREE_METADATA).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{state_dir / TREE_METADATA}: unreadable ({e}); the checkpoint is damaged: "
                              f"{RECONVERT}") from e
    if metadata.get("use_ocdbt") is not True or metadata.get("use_zarr3") is not True:
        raise CheckpointError(f"{state_dir}: arrays stored with use_ocdbt={metadata.get('use_ocdbt')!r}, "
                              f"use_zarr3={metadata.get('use_zarr3')!r}; the expert reader reads zarr3 over OCDBT "
                              f"(what jmoe.convert writes): {RECONVERT}")
    if not (state_dir / OCDBT_MANIFEST).is_file():
        raise CheckpointError(f"{state_dir}: no {OCDBT_MANIFEST}; the checkpoint is incomplete: {RECONVERT}")
    return state_dir


def _read_value(fd: int, value: _Value, buffers: BufferPool, pieces: PriorityPool, direct: bool) -> np.ndarray:
    """uint8: the value's bytes from its data file, in a block of `buffers` (module level: tests inject read faults
    here)."""
    return read_range(fd, value.offset, value.length, buffers, pieces,
                      lambda offset: OSError(f"the file ends at byte {offset}, inside the value"), direct)


class OrbaxExpertReader(PooledReader):
    """Routed experts of a jmoe Orbax checkpoint, read one at a time by byte range, one chunk per parameter.

    `cfg`: the checkpoint's config (its expert storage is the one the checkpoint was converted with; asking for
    another is an InputError, as for restore_model). `dtype`: the parameter dtype (default: the dtype the checkpoint
    was converted to, as restore_model). `threads`: reads in flight. `retries`: further attempts after a failed
    read. `direct`: read past the page cache (O_DIRECT, jmoe.checkpoint.read_buffers). Use as a context manager, or
    call `close()`.
    """

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, *, dtype=None, threads: int = 8, retries: int = 2,
                 direct: bool = False):
        self.model_dir = Path(model_dir).absolute()
        self.direct = direct
        self._threads = whole_number("threads", threads, 1, "expert reads in flight")
        self._retries = whole_number("retries", retries, 0, "further attempts after a failed read")
        manifest = read_manifest(self.model_dir)
        self.cfg = converted_expert_dtype(self.model_dir, manifest, cfg, cfg.expert_dtype, None)
        self._dtype = np.dtype(jnp.dtype(dtype or manifest["dtype"]))
        abstract = abstract_params(self.cfg, self._dtype)
        check_params(self.model_dir, manifest, abstract, self.cfg)
        self._state_dir = _pytree_dir(self.model_dir / PARAMS_DIR)
        self._params: dict[int, tuple[_Param, ...]] = {}
        for path, struct in abstract.items():
            if is_expert_param(path):
                self._params.setdefault(path[1], ())
                self._params[path[1]] += (self._param(manifest, path, struct),)
        self.layers: tuple[int, ...] = tuple(sorted(self._params))  # the MoE layers' decoder layer indices
        self.num_experts: int = self.cfg.num_experts
        self._check_stored_arrays()
        self._chunks = self._locate_chunks()  # (layer, expert, name) -> its chunk
        self._identity = self._record_files()  # file -> (size, mtime_ns) at construction
        self._files = {(layer, e): self._touched(layer, e) for layer in self.layers for e in range(self.num_experts)}
        self._check_chunks_inside_files()
        self._fds: dict[Path, int] = {}
        # Closes the files once: at close(), or when a reader nobody closed is collected.
        self._close_files = weakref.finalize(self, close_descriptors, self._fds)
        for path in sorted({c.value.file for c in self._chunks.values() if c.value.file is not None}):
            self._fds[path] = open_for_reads(path, direct)
        self._buffers = BufferPool(keep=self._threads)
        self._lock = threading.Lock()
        self._closed = False
        self._pool = expert_threads(self._threads, THREAD_PREFIX)
        self._pieces = piece_threads(self._threads)

    # ---- public (submit, read, close: PooledReader) ----

    def checkpoint_bytes(self, layer: int, expert: int) -> int:
        """Bytes of the chunks one read of this expert reads: its stored values of every parameter, with zarr's
        shard index (a chunk under 1 KiB sits inline in a B+tree node, read once with the node)."""
        layer, expert = self._key(layer, expert)
        return sum(self._chunks[layer, expert, p.name].value.length for p in self._params[layer])

    def _release(self) -> None:
        self._close_files()

    # ---- construction ----

    def _param(self, manifest: dict, path: tuple, struct) -> _Param:
        key = param_key(path)
        entry = manifest["params"][key]
        crcs = entry.get(EXPERT_CRC32)
        if crcs is None:
            raise CheckpointError(f"{self.model_dir}: the manifest has no per-expert CRC-32s for {key} (converted "
                                  f"before jmoe recorded them, and before experts were stored one per chunk, so one "
                                  f"expert cannot be read alone); restore_model still loads it whole. To read experts "
                                  f"from disk, {RECONVERT}")
        if len(crcs) != struct.shape[0]:
            raise CheckpointError(f"{self.model_dir}: the manifest lists {len(crcs)} per-expert CRC-32s for {key}, "
                                  f"which has {struct.shape[0]} experts; the manifest is damaged: {RECONVERT}")
        return _Param(path[-1], key, np.dtype(stored_dtype(manifest, entry)), np.dtype(struct.dtype),
                      tuple(struct.shape[1:]), tuple(int(c) for c in crcs))

    def _check_stored_arrays(self) -> None:
        """Each experts parameter's stored array, opened with TensorStore, must be what the converter writes."""
        # No cache for array chunks (none is read here); one for the OCDBT manifest and B+tree nodes.
        context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                              "cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES}})
        for layer in self.layers:
            for p in self._params[layer]:
                self._check_stored_array(p, context)

    def _locate_chunks(self) -> dict[tuple[int, int, str], _Chunk]:
        params = {p.key: (layer, p) for layer in self.layers for p in self._params[layer]}
        try:
            found = _ocdbt_chunks(self._state_dir, set(params))
        except (ValueError, KeyError, TypeError, OSError) as e:  # TensorStore reports a bad database as ValueError
            raise CheckpointError(f"{self._state_dir}: its OCDBT database cannot be read ({_first_line(e)}); the "
                                  f"checkpoint is damaged: {RECONVERT}") from e
        chunks = {}
        for key, (layer, p) in params.items():
            by_expert: dict[int, list[_Chunk]] = {}
            for grid, chunk in found[key]:
                if len(grid) != len(p.shape) + 1:
                    raise CheckpointError(f"{self._state_dir}: {key} has chunk {chunk.key!r}, not a chunk of a "
                                          f"{len(p.shape) + 1}-D array; the checkpoint is damaged: {RECONVERT}")
                by_expert.setdefault(grid[0], []).append(chunk)
            for e in range(self.num_experts):
                if not by_expert.get(e):
                    raise CheckpointError(f"{self._state_dir}: no stored chunk of {key} expert {e} (layer {layer}); "
                                          f"the checkpoint is incomplete: {RECONVERT}")
                if len(by_expert[e]) != 1:
                    raise CheckpointError(self._not_per_expert(key, f"{len(by_expert[e])} chunks of expert {e}"))
                chunks[layer, e, p.name] = by_expert[e][0]
            if len(by_expert) != self.num_experts:  # chunk rows past the experts: not one expert per chunk
                raise CheckpointError(self._not_per_expert(key, f"chunk rows {sorted(by_expert)}"))
        return chunks

    def _not_per_expert(self, key: str, found: str) -> str:
        return (f"{self._state_dir}: {key} is not stored one expert per chunk ({found}); one expert's read would "
                f"read others too. It was converted before jmoe chunked experts; restore_model still loads it "
                f"whole. To read experts from disk, {RECONVERT}")

    def _record_files(self) -> dict[Path, tuple[int, int]]:
        files = {self._state_dir / OCDBT_MANIFEST}
        for chunk in self._chunks.values():
            files.update(chunk.nodes)
            if chunk.value.file is not None:
                files.add(chunk.value.file)
        identity = {}
        for path in sorted(files):
            try:
                st = os.stat(path)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot read this file of the checkpoint ({e}); the checkpoint is "
                                      f"incomplete or unreadable: {RECONVERT}") from e
            identity[path] = (st.st_size, st.st_mtime_ns)
        return identity

    def _touched(self, layer: int, expert: int) -> tuple[Path, ...]:
        """The files one read of this expert reads (or, for the manifest and B+tree nodes, may read)."""
        files = {self._state_dir / OCDBT_MANIFEST}
        for p in self._params[layer]:
            chunk = self._chunks[layer, expert, p.name]
            files.update(chunk.nodes)
            if chunk.value.file is not None:
                files.add(chunk.value.file)
        return tuple(sorted(files))

    def _check_chunks_inside_files(self) -> None:
        for (layer, e, name), chunk in self._chunks.items():
            value = chunk.value
            shard = self._param_named(layer, name).nbytes + SHARD_INDEX_BYTES
            if value.length != shard:
                raise CheckpointError(
                    f"{self._state_dir}: {self._what(layer, e, name)} ({chunk.describe(self._state_dir)}) has "
                    f"{value.length} bytes, but one stored expert with its shard index takes {shard}; the checkpoint "
                    f"is damaged: {RECONVERT}")
            if value.file is not None and value.offset + value.length > self._identity[value.file][0]:
                raise CheckpointError(
                    f"{value.file}: {self._what(layer, e, name)} ({chunk.describe(self._state_dir)}) ends at "
                    f"byte {value.offset + value.length}, but the file has {self._identity[value.file][0]} "
                    f"bytes; the file is truncated: {RECONVERT}")

    def _param_named(self, layer: int, name: str) -> _Param:
        return next(p for p in self._params[layer] if p.name == name)

    def _check_stored_array(self, p: _Param, context: ts.Context) -> None:
        """The stored array of `p` must hold one expert per chunk, each one shard of raw little-endian values."""
        spec = {"driver": "zarr3",
                "kvstore": {"driver": "ocdbt", "base": _files_under(self._state_dir), "path": p.key,
                            "cache_pool": "cache_pool#ocdbt"},
                "recheck_cached_data": False, "recheck_cached_metadata": False, "fill_missing_data_reads": False}
        try:
            store = ts.open(spec, read=True, open=True, context=context).result()
        except ValueError as e:
            raise CheckpointError(f"{self._state_dir}: cannot open {p.key} ({_first_line(e)}); the checkpoint is "
                                  f"damaged: {RECONVERT}") from e
        if tuple(store.shape) != (self.num_experts,) + p.shape or np.dtype(store.dtype.numpy_dtype) != p.stored:
            raise CheckpointError(f"{self._state_dir}: {p.key} is stored as {store.dtype.name} "
                                  f"{list(store.shape)}, but the manifest says {p.stored.name} "
                                  f"{[self.num_experts, *p.shape]}; the checkpoint is damaged: {RECONVERT}")
        chunk_shape = tuple(store.chunk_layout.read_chunk.shape)
        if chunk_shape != (1,) + p.shape:
            raise CheckpointError(self._not_per_expert(p.key, f"chunks of {list(chunk_shape)}"))
        codecs = store.codec.to_json().get("codecs")
        if codecs != _raw_shard_codecs(list(chunk_shape), p.stored):
            raise CheckpointError(f"{self._state_dir}: {p.key} is stored with the zarr3 codecs {codecs}; the expert "
                                  f"reader reads the converter's: {_raw_shard_codecs(list(chunk_shape), p.stored)} "
                                  f"(each expert one shard of raw values, nothing to decode): {RECONVERT}")

    def _key(self, layer, expert) -> tuple[int, int]:
        key = (layer, expert)
        if (not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in key)
                or layer not in self._params or not 0 <= expert < self.num_experts):
            raise InputError(f"layer {layer!r} expert {expert!r} is not a routed expert of {self.model_dir}: the MoE "
                             f"layers are {list(self.layers)}, experts 0..{self.num_experts - 1}")
        return int(layer), int(expert)

    # ---- one read, on a pool thread ----

    def _read_expert(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        layer, expert = key
        self._check_unchanged(key, "before")
        out = {p.name: self._values(key, p, self._stored_bytes(key, p)) for p in self._params[layer]}
        self._check_unchanged(key, "after")
        for p in self._params[layer]:
            self._check_crc(key, p, out[p.name])
        return {p.name: self._as_held(p, out[p.name]) for p in self._params[layer]}

    def _stored_bytes(self, key: tuple[int, int], p: _Param) -> np.ndarray:
        """uint8: the expert's chunk of `p` as stored (values, then the shard index)."""
        value = self._chunks[key[0], key[1], p.name].value
        if value.file is not None:
            return self._file_bytes(key, p, value)
        into = self._buffers.lease(value.length)
        into[:] = np.frombuffer(value.inline, np.uint8)
        return into

    def _file_bytes(self, key: tuple[int, int], p: _Param, value: _Value) -> np.ndarray:
        """uint8: `value`'s bytes from its data file, in a buffer of the pool; a failed read is retried `retries`
        times (a file that changed is reported as such at once, never retried)."""
        layer, expert = key
        attempts = self._retries + 1
        for _ in range(attempts):
            try:
                return _read_value(self._fds[value.file], value, self._buffers, self._pieces, self.direct)
            except OSError as e:
                self._check_unchanged(key, "after a failed attempt at")
                error = e
        raise CheckpointError(f"{self._state_dir}: reading {self._what(layer, expert, p.name)} "
                              f"({self._chunks[layer, expert, p.name].describe(self._state_dir)}) failed {attempts} "
                              f"times ({attempts} attempts: 1 + retries={self._retries}); last error: {error}. Check "
                              f"the disk and the files (a failing drive, a network mount that went away), then load "
                              f"the model again, or pass a larger `retries` for a flaky mount") from error

    def _values(self, key: tuple[int, int], p: _Param, stored: np.ndarray) -> np.ndarray:
        """The expert's values of `p` (a view of `stored`), after checking the shard index names them."""
        nbytes = p.nbytes
        offset, length = stored[nbytes:nbytes + 16].view("<u8")
        if (offset, length) != (0, nbytes):
            chunk = self._chunks[key[0], key[1], p.name]
            raise CheckpointError(f"{chunk.value.file or self._state_dir}: {self._what(*key, p.name)} "
                                  f"({chunk.describe(self._state_dir)}) has a shard index naming bytes {offset} to "
                                  f"{offset + length}, where its values are bytes 0 to {nbytes}: the data file is "
                                  f"damaged; {RECONVERT}")
        return stored[:nbytes].view(p.stored).reshape(p.shape)

    def _check_unchanged(self, key: tuple[int, int], when: str) -> None:
        for path in self._files[key]:
            try:
                st = os.stat(path)
                found = f"{st.st_size} bytes with mtime {st.st_mtime_ns} ns"
                same = (st.st_size, st.st_mtime_ns) == self._identity[path]
            except FileNotFoundError:
                found, same = "missing", False
            except OSError as e:
                found, same = f"unreadable ({e})", False
            if not same:
                size, mtime = self._identity[path]
                raise CheckpointError(f"{path}: the checkpoint file changed while the model runs: {size} bytes with "
                                      f"mtime {mtime} ns when the reader opened it, {found} {when} reading layer "
                                      f"{key[0]} expert {key[1]} (parameters "
                                      f"{', '.join(p.key for p in self._params[key[0]])}); {RESTART}")

    def _check_crc(self, key: tuple[int, int], p: _Param, stored: np.ndarray) -> None:
        """The expert's bytes must be those the converter wrote (the manifest's per-expert CRC-32)."""
        layer, expert = key
        crc = crc32(np.ascontiguousarray(stored).reshape(-1).view(np.uint8))
        if crc != p.crcs[expert]:
            chunk = self._chunks[layer, expert, p.name]
            raise CheckpointError(f"{chunk.value.file or self._state_dir}: {self._what(layer, expert, p.name)} "
                                  f"({chunk.describe(self._state_dir)}) has CRC-32 {crc:#010x}, but the "
                                  f"converter recorded {p.crcs[expert]:#010x}: the data file is damaged, or was "
                                  f"rewritten keeping its size and mtime; {RECONVERT}")

    def _as_held(self, p: _Param, stored: np.ndarray) -> np.ndarray:
        """Cast as Orbax's restore casts (TensorStore's cast driver), when the parameter dtype differs."""
        if p.dtype == p.stored:
            return stored
        return ts.cast(ts.array(stored), ts.dtype(p.dtype.name)).read().result()

    def _what(self, layer: int, expert: int, name: str) -> str:
        key = self._param_named(layer, name).key
        return f"parameter {key} expert {expert} (layer {layer} expert {expert})"


def _raw_shard_codecs(chunk_shape: list[int], stored: np.dtype) -> list[dict]:
    """The zarr3 codecs the converter's arrays have (Orbax's defaults, uncompressed): each chunk one shard of one
    inner chunk of raw little-endian values, the shard index (little-endian, with a CRC-32C) at its end."""
    raw = {"name": "bytes"} if stored.itemsize == 1 else {"configuration": {"endian": "little"}, "name": "bytes"}
    return [{"configuration": {"chunk_shape": chunk_shape, "codecs": [raw],
                               "index_codecs": [{"configuration": {"endian": "little"}, "name": "bytes"},
                                                {"name": "crc32c"}],
                               "index_location": "end"},
             "name": "sharding_indexed"}]


def _first_line(error: BaseException) -> str:
    """TensorStore's first sentence, without the spec dump that follows it."""
    line = (str(error).splitlines() or [type(error).__name__])[0]
    return line.split(" [tensorstore_spec")[0][:300]


def open_expert_reader(model_dir: str | Path, cfg: ModelConfig, **kwargs) -> ExpertReader | OrbaxExpertReader:
    """The expert reader for `model_dir`'s format: OrbaxExpertReader for a jmoe Orbax checkpoint, ExpertReader
    for a Hugging Face safetensors directory; `kwargs` (dtype, threads, retries) go to it."""
    reader = OrbaxExpertReader if is_orbax_checkpoint(model_dir) else ExpertReader
    return reader(model_dir, cfg, **kwargs)
