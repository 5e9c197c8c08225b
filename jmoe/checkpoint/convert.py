"""Convert a Hugging Face safetensors checkpoint into jmoe's Orbax format (jmoe.checkpoint.orbax_store).

Conversion streams one parameter group at a time (the top-level parameters, then each decoder layer):
a group is assembled on the host with `stored_params` (quantizing experts when asked) and appended to the Orbax checkpoint with
Orbax's partial save, so peak memory is about one layer's experts, not the model. Everything is written
into a temporary directory next to the output and renamed into place at the end, so an interrupted
conversion never leaves a directory that restores; SIGINT and SIGTERM remove it, and a later conversion
into the same parent removes those whose owner (a process on this host, recorded in OWNER_FILE) is gone.
`--overwrite` replaces only a jmoe checkpoint or an empty directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp_pkg
import orbax.checkpoint.experimental.v1 as ocp
from tqdm import tqdm

from jmoe.checkpoint.bounds import check_sizes_against_tensors
from jmoe.checkpoint.checksum import crc32
from jmoe.checkpoint.loading import param_pieces, params_as_read, stored_params
from jmoe.checkpoint.orbax_store import (COPIED_FILES, FORMAT, FORMAT_VERSION, MANIFEST, MARKER, PARAMS_DIR,
                                         EXPERT_CRC32, TMP_INFIX, checksum, is_expert_param, is_orbax_checkpoint,
                                         orbax_key, param_groups)
from jmoe.model.params import abstract_params, nest_params, param_key
from jmoe.checkpoint.safetensors_files import checkpoint_files, stored_values
from jmoe.jsonfile import read_json
from jmoe.config import load_config, with_expert_dtype
from jmoe.errors import CheckpointError, InputError


def _sha256(path: Path, bar: tqdm) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _source_record(hf_dir: Path, progress: bool) -> list[dict]:
    files = checkpoint_files(hf_dir)
    sizes = [f.stat().st_size for f in files]
    with tqdm(total=sum(sizes), desc="hashing source", unit="B", unit_scale=True, disable=not progress,
              leave=False) as bar:
        return [{"name": f.name, "bytes": size, "sha256": _sha256(f, bar)} for f, size in zip(files, sizes)]


def _check_output(hf_dir: Path, out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: the output path exists and is a file; expected a directory path "
                              f"(empty or new); choose another output path")
    source = hf_dir.resolve()
    if out_dir.resolve() == source or out_dir.resolve() in source.parents:
        raise CheckpointError(f"{out_dir}: the output directory contains the source checkpoint {hf_dir}; "
                              f"converting there would replace the source; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{out_dir}: the output directory is not empty; pass --overwrite (overwrite=True) "
                                  f"to replace a jmoe checkpoint there, or choose another output path")
        if not is_orbax_checkpoint(out_dir):
            raise CheckpointError(f"{out_dir}: the output directory is not empty and is not a jmoe checkpoint; "
                                  f"--overwrite replaces only a jmoe checkpoint or an empty directory: choose "
                                  f"another output path or empty it yourself")


OWNER_FILE = "jmoe_converting_owner.json"  # in a temporary directory: the process writing it


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_temporaries(parent: Path, name: str) -> None:
    """Remove temporary directories of conversions into `parent / name` whose process on this host is gone
    (a SIGKILL leaves them); any other directory, or one whose owner is unknown or alive, is kept."""
    for candidate in parent.glob(f".{name}{TMP_INFIX}*"):
        try:
            owner = json.loads((candidate / OWNER_FILE).read_text())
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host == socket.gethostname() and not _process_alive(pid):
            shutil.rmtree(candidate, ignore_errors=True)


@contextlib.contextmanager
def _termination_raises():
    """SIGTERM raises SystemExit while converting, so the cleanup that follows an exception runs."""
    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _inside_model(path: Path, hf_dir: Path) -> bool:
    """Whether `path` resolves inside the model directory, or into the blob store of the Hugging Face cache
    repository the directory is a snapshot of (models--ORG--NAME/snapshots/REV -> models--ORG--NAME/blobs)."""
    target, home = path.resolve(), hf_dir.resolve()
    if target.parent == home:
        return True
    repository = home.parent.parent
    return home.parent.name == "snapshots" and target.parent == repository / "blobs"


def _copy_checked_files(hf_dir: Path, tmp: Path) -> list[str]:
    """Copy config, generation config and tokenizer files, each checked first: inside the model directory
    (a symlink may not lead elsewhere) and readable as what it claims to be."""
    copied = []
    for name in COPIED_FILES:
        source = hf_dir / name
        if not source.is_file():
            continue
        if not _inside_model(source, hf_dir):
            raise CheckpointError(f"{source}: a link to {source.resolve()}, outside the model directory; copy the "
                                  f"real file into {hf_dir} if it belongs to this model")
        if name.endswith(".json"):
            read_json(source, name, CheckpointError, "fix or remove it before converting")
        if name == "tokenizer.json":
            from tokenizers import Tokenizer

            try:
                Tokenizer.from_file(str(source))
            except Exception as e:  # tokenizers raises a bare Exception for any unreadable file
                raise CheckpointError(f"{source}: not a tokenizer the `tokenizers` library can load ({e}); fix or "
                                      f"remove it before converting") from None
        shutil.copy2(source, tmp / name)
        copied.append(name)
    return copied


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, dtype=None, expert_dtype: str | None = None,
                       expert_group_size: int | None = None, overwrite: bool = False, progress: bool = True) -> Path:
    """Convert the HF checkpoint in `hf_dir` to a jmoe Orbax checkpoint at `out_dir`; returns `out_dir`.

    dtype: parameter dtype to store (default: the checkpoint's dtype in config.json).
    expert_dtype, expert_group_size: how to store the routed experts, as jmoe.load's (e.g. "int4": quantized
        once here, recorded in the manifest, loaded as stored).
    overwrite: replace a non-empty `out_dir` (only once the new checkpoint is complete).
    """
    hf_dir, out_dir = Path(hf_dir).absolute(), Path(out_dir).absolute()  # Orbax needs absolute paths
    cfg = load_config(hf_dir)
    try:
        dtype = np.dtype(jnp.dtype(dtype or cfg.dtype))
    except TypeError as e:
        raise InputError(f"dtype {dtype!r} is not a dtype; expected e.g. bfloat16 or float32") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise InputError(f"dtype {dtype} is not a floating-point type; expected e.g. bfloat16 or float32")
    cfg = with_expert_dtype(cfg, expert_dtype, expert_group_size)
    _check_output(hf_dir, out_dir, overwrite)
    check_sizes_against_tensors(hf_dir, cfg, stored_values(hf_dir))
    abstract, as_read = abstract_params(cfg, dtype), params_as_read(cfg, dtype)
    pieces = param_pieces(hf_dir, cfg, as_read)  # checks every tensor name and shape before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out_dir.parent, out_dir.name)
    with _termination_raises():
        _convert_into(hf_dir, out_dir, cfg, dtype, abstract, as_read, pieces, progress)
    return out_dir


def _convert_into(hf_dir: Path, out_dir: Path, cfg, dtype, abstract, as_read, pieces, progress: bool) -> None:
    """Write the checkpoint: `as_read` are the parameters as read (params_as_read), `abstract` as stored."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{TMP_INFIX}", dir=out_dir.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the checkpoint gets the usual permissions
        _write_json(tmp / OWNER_FILE, {"pid": os.getpid(), "host": socket.gethostname()})
        _write_json(tmp / MARKER, {"format": FORMAT, "format_version": FORMAT_VERSION})
        sources = _source_record(hf_dir, progress)
        # Orbax copies host arrays before writing unless told not to; we never touch them afterwards.
        save_context = ocp.Context()
        save_context.memory.deepcopy_host_arrays = False
        save_context.array.saving.use_compression = COMPRESS
        # Each routed expert in its own chunk (issue #31: experts read from disk one at a time): see
        # _one_chunk_per_expert.
        save_context.array.saving.scoped_storage_options_creator = _one_chunk_per_expert
        checksums = {}  # param key -> CRC-32 of the stored bytes (restore verifies them)
        expert_crcs = {}  # experts param key -> CRC-32 of each expert's stored bytes (the expert readers verify them)
        with save_context, tqdm(total=len(as_read), desc="converting", unit="param", disable=not progress) as bar:
            for group, paths in param_groups(as_read).items():
                bar.set_postfix_str(param_key(group) or "embeddings")
                host = {}
                for path in paths:
                    for stored_path, array in stored_params(hf_dir, cfg, as_read, pieces, path, True).items():
                        host[orbax_key(stored_path)] = array
                        checksums[param_key(stored_path)] = checksum(array)
                        if is_expert_param(stored_path):
                            expert_crcs[param_key(stored_path)] = expert_checksums(array)
                    bar.update()
                ocp.partial.save(tmp / PARAMS_DIR, nest_params(host))
                del host  # free this group before assembling the next
            ocp.partial.finalize(tmp / PARAMS_DIR)
        copied = _copy_checked_files(hf_dir, tmp)
        _write_json(tmp / MANIFEST, {
            "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
            "expert_dtype": cfg.expert_dtype, "expert_group": cfg.expert_group,
            "params": {param_key(p): {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name,
                                      "crc32": checksums[param_key(p)],
                                      **({EXPERT_CRC32: expert_crcs[param_key(p)]}
                                         if param_key(p) in expert_crcs else {})} for p, a in abstract.items()},
            "source": {"directory": str(hf_dir.resolve()), "files": sources},
            "copied_files": copied,
            "versions": {"orbax-checkpoint": ocp_pkg.__version__, "jax": jax.__version__},
        })
        (tmp / OWNER_FILE).unlink()
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# zstd saved 22% of disk on random bf16 experts but made saving 6x and restoring 1.4x slower
# (bench/results/convert.md); loading fast is the point of converting. The expert readers read raw chunks only.
COMPRESS = False


def _one_chunk_per_expert(keypath, value):
    """Orbax storage options of one leaf: a routed experts parameter is chunked along its expert axis, one expert
    per chunk (shard_axes=(0,): Orbax's chunk chooser splits axis 0 down to 1 first, and with no chunk_byte_size
    splits nothing else), so one expert is one OCDBT value, readable without the others
    (jmoe.checkpoint.expert_reader_orbax). Every other leaf keeps Orbax's default (one chunk per array)."""
    keys = tuple(str(getattr(k, "key", k)) for k in keypath)
    if is_expert_param(keys) and np.ndim(value) >= 1:
        return ocp.options.ArrayOptions.Saving.StorageOptions(shard_axes=(0,))
    return None


def expert_checksums(array) -> list[int]:
    """CRC-32 of each expert's bytes as stored (`array[e]` of a stacked experts parameter, expert axis first):
    the manifest's "expert_crc32", so one expert read alone can be checked against what the converter wrote."""
    host = np.ascontiguousarray(jax.device_get(array))
    return [crc32(host[e].view(np.uint8).reshape(-1)) for e in range(host.shape[0])]


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # the manifest marks completion: it must be on disk before the rename


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished `tmp` to `out_dir`; an existing `out_dir` (overwrite) is moved aside first."""
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.jmoe-replaced-", dir=out_dir.parent))
        out_dir.rename(old / "old")
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
