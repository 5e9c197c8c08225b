"""Convert a Hugging Face safetensors checkpoint to an Orbax checkpoint in jmoe's layout, and restore it.

Conversion streams one parameter group at a time (the top-level parameters, then each decoder layer):
a group is assembled on the host with `assemble_param` and appended to the Orbax checkpoint with
Orbax's partial save, so peak memory is about one layer's experts, not the model. Everything is written
into a temporary directory next to the output and renamed into place at the end, so an interrupted
conversion never leaves a directory that restores.

Output layout:
    jmoe_orbax.json       marker, written first: {"format": "jmoe-orbax", "format_version": 1}
    params/               the Orbax checkpoint: nested dict of arrays, keys are the jmoe parameter
                          path as strings, e.g. params["layers"]["3"]["mlp"]["experts"]["w_down"]
    config.json, generation_config.json, tokenizer files   copied from the source
    jmoe_manifest.json    written last: dtype, every parameter's shape, source files with sizes and sha256

Restoring reads each group straight into the memory kind `memory_kind_of(path)` asks for, so experts
meant for pinned host memory never pass through device memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp_pkg
import orbax.checkpoint.experimental.v1 as ocp
from flax import nnx
from tqdm import tqdm

from jmoe.config import ModelConfig, load_config
from jmoe.errors import CheckpointError, InputError
from jmoe.hf_layout import ParamPath, param_key
from jmoe.loading import abstract_model, assemble_param, flat_params, nest_params, param_pieces
from jmoe.model import MoETransformer
from jmoe.safetensors_reader import checkpoint_files

FORMAT = "jmoe-orbax"
FORMAT_VERSION = 1
MARKER = "jmoe_orbax.json"
MANIFEST = "jmoe_manifest.json"
PARAMS_DIR = "params"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.jinja")
MEMORY_KINDS = ("device", "pinned_host")
_TMP_INFIX = ".jmoe-converting-"

MemoryKindOf = Callable[[ParamPath], str]


def _groups(paths) -> dict[tuple, list[ParamPath]]:
    """Parameters grouped for streaming: () for the top-level ones, ("layers", i) for each decoder layer."""
    groups: dict[tuple, list[ParamPath]] = {}
    for path in paths:
        groups.setdefault(path[:2] if path[0] == "layers" else (), []).append(path)
    return groups


def _orbax_key(path: ParamPath) -> tuple[str, ...]:
    return tuple(str(p) for p in path)  # Orbax tree keys must be strings; layer indices become "3"


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
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir}: the output directory is not empty; pass --overwrite (overwrite=True) "
                              f"to replace its contents, or choose another output path")


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, dtype=None, overwrite: bool = False,
                       progress: bool = True) -> Path:
    """Convert the HF checkpoint in `hf_dir` to a jmoe Orbax checkpoint at `out_dir`; returns `out_dir`.

    dtype: parameter dtype to store (default: the checkpoint's dtype in config.json).
    overwrite: replace a non-empty `out_dir` (only once the new checkpoint is complete).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    cfg = load_config(hf_dir)
    try:
        dtype = np.dtype(jnp.dtype(dtype or cfg.dtype))
    except TypeError as e:
        raise InputError(f"dtype {dtype!r} is not a dtype; expected e.g. bfloat16 or float32") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise InputError(f"dtype {dtype} is not a floating-point type; expected e.g. bfloat16 or float32")
    _check_output(hf_dir, out_dir, overwrite)
    abstract = flat_params(nnx.to_pure_dict(abstract_model(cfg, dtype)[1]))
    pieces = param_pieces(hf_dir, cfg, abstract)  # checks every tensor name and shape before any work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{_TMP_INFIX}", dir=out_dir.parent))
    try:
        _write_json(tmp / MARKER, {"format": FORMAT, "format_version": FORMAT_VERSION})
        sources = _source_record(hf_dir, progress)
        # Orbax copies host arrays before writing unless told not to; we never touch them afterwards.
        save_context = ocp.Context()
        save_context.memory.deepcopy_host_arrays = False
        # zstd saved 22% of disk on random bf16 experts but made saving 6x and restoring 1.4x slower
        # (bench/results/convert.md); loading fast is the point of converting.
        save_context.array.saving.use_compression = False
        with save_context, tqdm(total=len(abstract), desc="converting", unit="param", disable=not progress) as bar:
            for group, paths in _groups(abstract).items():
                bar.set_postfix_str(param_key(group) or "embeddings")
                host = {}
                for path in paths:
                    host[_orbax_key(path)] = assemble_param(abstract[path].shape, dtype, pieces[path])
                    bar.update()
                ocp.partial.save(tmp / PARAMS_DIR, nest_params(host))
                del host  # free this group before assembling the next
            ocp.partial.finalize(tmp / PARAMS_DIR)
        copied = [name for name in COPIED_FILES if (hf_dir / name).is_file()]
        for name in copied:
            shutil.copy2(hf_dir / name, tmp / name)
        _write_json(tmp / MANIFEST, {
            "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
            "params": {param_key(p): {"shape": list(a.shape)} for p, a in abstract.items()},
            "source": {"directory": str(hf_dir.resolve()), "files": sources},
            "copied_files": copied,
            "versions": {"orbax-checkpoint": ocp_pkg.__version__, "jax": jax.__version__},
        })
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


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


def is_orbax_checkpoint(path: str | Path) -> bool:
    """True for a directory written by the jmoe converter (complete or not: `restore_model` checks that).

    A Hugging Face directory has none of the converter's files, so this tells the two apart.
    """
    path = Path(path)
    return path.is_dir() and any((path / name).exists() for name in (MARKER, MANIFEST, PARAMS_DIR))


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the {what} is not valid JSON ({e}); the checkpoint is damaged: "
                              f"convert it again with `python -m jmoe.convert`") from e


def read_manifest(orbax_dir: str | Path) -> dict:
    """The manifest of a complete jmoe Orbax checkpoint; CheckpointError naming what is missing otherwise."""
    orbax_dir = Path(orbax_dir)
    redo = f"convert again with `python -m jmoe.convert HF_DIR {orbax_dir} --overwrite`"
    if not orbax_dir.is_dir():
        raise CheckpointError(f"{orbax_dir}: no such directory; expected a jmoe Orbax checkpoint directory")
    if _TMP_INFIX in orbax_dir.name:
        raise CheckpointError(f"{orbax_dir}: this is the temporary directory of an unfinished conversion, not a "
                              f"checkpoint; delete it and {redo}")
    if not (orbax_dir / MARKER).is_file():
        raise CheckpointError(f"{orbax_dir}: no {MARKER}; expected a jmoe Orbax checkpoint written by "
                              f"`python -m jmoe.convert` (a Hugging Face directory loads with jmoe.load); "
                              f"if this was converted, the directory is incomplete: {redo}")
    marker = _read_json(orbax_dir / MARKER, "format marker")
    if marker.get("format") != FORMAT or marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{orbax_dir / MARKER}: expected format {FORMAT!r} version {FORMAT_VERSION}, found "
                              f"{marker.get('format')!r} version {marker.get('format_version')!r}; {redo} "
                              f"with this version of jmoe")
    if not (orbax_dir / MANIFEST).is_file():
        raise CheckpointError(f"{orbax_dir}: no {MANIFEST}; the conversion did not finish or the directory "
                              f"was copied incompletely: {redo}")
    manifest = _read_json(orbax_dir / MANIFEST, "manifest")
    if not ocp.is_orbax_checkpoint(orbax_dir / PARAMS_DIR):
        raise CheckpointError(f"{orbax_dir / PARAMS_DIR}: missing or not an Orbax checkpoint; the directory "
                              f"is incomplete: {redo}")
    return manifest


def _check_params(orbax_dir: Path, manifest: dict, abstract: dict[ParamPath, object], cfg: ModelConfig) -> None:
    stored = {name: tuple(entry["shape"]) for name, entry in manifest["params"].items()}
    wanted = {param_key(p): tuple(a.shape) for p, a in abstract.items()}
    missing = sorted(set(wanted) - set(stored))
    unexpected = sorted(set(stored) - set(wanted))
    wrong = [f"{n} (stored {list(stored[n])}, expected {list(wanted[n])})"
             for n in wanted if n in stored and stored[n] != wanted[n]]
    problems = [f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                for what, names in (("missing parameters", missing), ("unexpected parameters", unexpected),
                                    ("shape mismatches", wrong)) if names]
    if problems:
        raise CheckpointError(f"{orbax_dir}: the checkpoint does not match the config (model_type "
                              f"{cfg.family!r}): " + "; ".join(problems) + "; pass the config.json it was "
                              "converted from")


def restore_model(orbax_dir: str | Path, cfg: ModelConfig, *, dtype=None, memory_kind_of: MemoryKindOf | None = None,
                  progress: bool = True) -> MoETransformer:
    """Restore a converted checkpoint into a MoETransformer, each array directly in its memory kind.

    dtype: parameter dtype (default: the dtype the checkpoint was converted to).
    memory_kind_of: jmoe parameter path, e.g. ("layers", 3, "mlp", "experts", "w_down") -> "device" or
        "pinned_host"; default: everything on "device".
    """
    orbax_dir = Path(orbax_dir)
    manifest = read_manifest(orbax_dir)
    dtype = np.dtype(jnp.dtype(dtype or manifest["dtype"]))
    graphdef, state = abstract_model(cfg, dtype)
    abstract = flat_params(nnx.to_pure_dict(state))
    _check_params(orbax_dir, manifest, abstract, cfg)
    device = jax.devices()[0]
    loaded = {}
    load_context = ocp.Context()
    load_context.pytree.loading.partial_load = True  # one group at a time
    with load_context, tqdm(total=len(abstract), desc="restoring", unit="param", disable=not progress,
                            leave=False) as bar:
        for group, paths in _groups(abstract).items():
            targets = {}
            for path in paths:
                kind = memory_kind_of(path) if memory_kind_of else "device"
                if kind not in MEMORY_KINDS:
                    raise InputError(f"memory_kind_of({path}) returned {kind!r}; expected one of {MEMORY_KINDS}")
                targets[_orbax_key(path)] = jax.ShapeDtypeStruct(
                    abstract[path].shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
            try:
                restored = ocp.load(orbax_dir / PARAMS_DIR, nest_params(targets))
            except Exception as e:  # Orbax reports unreadable data as a bare Exception
                # keep TensorStore's first sentence; its spec dump follows in the chained exception
                first_line = (str(e).splitlines() or [type(e).__name__])[0]
                first_line = first_line.split(" See full TensorStore")[0].split(" [tensorstore_spec")[0][:300]
                raise CheckpointError(f"{orbax_dir / PARAMS_DIR}: reading {param_key(group) or 'embeddings'} "
                                      f"failed ({first_line}); the checkpoint is damaged or incomplete: "
                                      f"convert it again with `python -m jmoe.convert`") from e
            flat = flat_params(restored)
            for path in paths:
                loaded[path] = flat[_orbax_key(path)]
            bar.update(len(paths))
    nnx.replace_by_pure_dict(state, nest_params(loaded))
    return nnx.merge(graphdef, state)
