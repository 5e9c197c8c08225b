"""jmoe's Orbax checkpoint format: its files, telling it apart from a Hugging Face directory, and restoring it.

Layout (written by jmoe.checkpoint.convert):
    jmoe_orbax.json       marker, written first: {"format": "jmoe-orbax", "format_version": 2} (version 1 stored the
                          dense weights [in, out]; 2 stores them [out, in], as the model holds them)
    params/               the Orbax checkpoint: nested dict of arrays, keys are the jmoe parameter
                          path as strings, e.g. params["layers"]["3"]["mlp"]["experts"]["w_down"]
    config.json, generation_config.json, tokenizer files   copied from the source
    jmoe_manifest.json    written last: dtype, expert_dtype and expert_group (how experts are stored), every
                          parameter's shape, dtype and CRC-32, source files with sizes and sha256; each routed
                          experts parameter also the CRC-32 of each expert's bytes ("expert_crc32", absent from
                          checkpoints converted before it was recorded)

Arrays are zarr3 under OCDBT (Orbax's defaults), uncompressed; a routed experts parameter (expert axis first) is
chunked one expert per chunk, so one expert is one OCDBT value that jmoe.checkpoint.expert_reader_orbax reads alone
(issue #31); every other parameter is one chunk.

Restoring reads each group straight into the sharding `sharding_of(path)` asks for (a memory kind, and under
an expert mesh each device's share), so experts meant for pinned host memory never pass through device memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jmoe.checkpoint.checksum import crc32
from jmoe.model.params import ParamPath, abstract_model, flat_params, nest_params, param_key
from jmoe.config import ModelConfig
from jmoe.errors import CheckpointError, InputError
from jmoe.jsonfile import read_json
from jmoe.memory import DEVICE, sharding_for
from jmoe.model import MoETransformer

FORMAT = "jmoe-orbax"
FORMAT_VERSION = 2
MARKER = "jmoe_orbax.json"
MANIFEST = "jmoe_manifest.json"
PARAMS_DIR = "params"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.jinja")
TMP_INFIX = ".jmoe-converting-"  # in the name of a conversion's temporary directory

ShardingOf = Callable[[ParamPath], jax.sharding.Sharding]


def orbax():
    """Orbax's v1 API, imported where a checkpoint is read (0.6 s: every `import jmoe` paid it before)."""
    import orbax.checkpoint.experimental.v1 as ocp

    return ocp


def param_groups(paths) -> dict[tuple, list[ParamPath]]:
    """Parameters grouped for streaming: () for the top-level ones, ("layers", i) for each decoder layer."""
    groups: dict[tuple, list[ParamPath]] = {}
    for path in paths:
        groups.setdefault(path[:2] if path[0] == "layers" else (), []).append(path)
    return groups


EXPERT_CRC32 = "expert_crc32"  # a manifest entry's per-expert CRC-32s (routed experts parameters only)


def is_expert_param(path) -> bool:
    """A routed experts module's stacked parameter (expert axis first): ("layers", i, "mlp", "experts", name)."""
    return len(path) >= 3 and path[0] == "layers" and path[-2] == "experts"


def orbax_key(path: ParamPath) -> tuple[str, ...]:
    return tuple(str(p) for p in path)  # Orbax tree keys must be strings; layer indices become "3"


def is_orbax_checkpoint(path: str | Path) -> bool:
    """True for a directory written by the jmoe converter (complete or not: `restore_model` checks that).

    A Hugging Face directory has none of the converter's files, so this tells the two apart.
    """
    path = Path(path)
    return path.is_dir() and any((path / name).exists() for name in (MARKER, MANIFEST, PARAMS_DIR))


def read_manifest(orbax_dir: str | Path) -> dict:
    """The manifest of a complete jmoe Orbax checkpoint; CheckpointError naming what is missing otherwise."""
    orbax_dir = Path(orbax_dir).absolute()  # Orbax works on absolute paths only
    redo = f"convert again with `python -m jmoe.convert HF_DIR {orbax_dir} --overwrite`"
    if not orbax_dir.is_dir():
        raise CheckpointError(f"{orbax_dir}: no such directory; expected a jmoe Orbax checkpoint directory")
    if TMP_INFIX in orbax_dir.name:
        raise CheckpointError(f"{orbax_dir}: this is the temporary directory of an unfinished conversion, not a "
                              f"checkpoint; delete it and {redo}")
    if not (orbax_dir / MARKER).is_file():
        raise CheckpointError(f"{orbax_dir}: no {MARKER}; expected a jmoe Orbax checkpoint written by "
                              f"`python -m jmoe.convert` (a Hugging Face directory loads with jmoe.load); "
                              f"if this was converted, the directory is incomplete: {redo}")
    damaged = "the checkpoint is damaged: convert it again with `python -m jmoe.convert`"
    marker = read_json(orbax_dir / MARKER, "format marker", CheckpointError, damaged)
    if marker.get("format") != FORMAT or marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{orbax_dir / MARKER}: expected format {FORMAT!r} version {FORMAT_VERSION}, found "
                              f"{marker.get('format')!r} version {marker.get('format_version')!r}; {redo} "
                              f"with this version of jmoe")
    if not (orbax_dir / MANIFEST).is_file():
        raise CheckpointError(f"{orbax_dir}: no {MANIFEST}; the conversion did not finish or the directory "
                              f"was copied incompletely: {redo}")
    manifest = read_json(orbax_dir / MANIFEST, "manifest", CheckpointError, damaged)
    if not orbax().is_orbax_checkpoint(orbax_dir / PARAMS_DIR):
        raise CheckpointError(f"{orbax_dir / PARAMS_DIR}: missing or not an Orbax checkpoint; the directory "
                              f"is incomplete: {redo}")
    return manifest


def checksum(array) -> int:
    """CRC-32 of an array's bytes as stored (host or device array): the converter records one per parameter,
    restore verifies it, so a flipped byte in a data file is an error, not different numbers."""
    host = np.ascontiguousarray(jax.device_get(array))
    return crc32(host.view(np.uint8).reshape(-1))


def verify_checksums(orbax_dir: Path, manifest: dict, restored: dict[str, object]) -> None:
    """Compare restored parameters (param key -> array, in the stored dtype) with the manifest's checksums."""
    for key, array in restored.items():
        recorded = manifest["params"][key].get("crc32")
        if recorded is not None and checksum(array) != recorded:
            raise CheckpointError(f"{orbax_dir / PARAMS_DIR}: parameter {key} does not match the checksum the "
                                  f"converter recorded; the data files are damaged: convert it again with "
                                  f"`python -m jmoe.convert`")


def stored_dtype(manifest: dict, entry: dict) -> str:
    """A parameter's stored dtype (checkpoints converted before quantized experts list one dtype for all)."""
    return entry.get("dtype", manifest["dtype"])


def converted_expert_dtype(orbax_dir: Path, manifest: dict, cfg: ModelConfig, expert_dtype: str | None,
                           group_size: int | None) -> ModelConfig:
    """`cfg` with the expert storage the checkpoint was converted with; asking for another one is an error,
    because the stored experts cannot be turned back into the source's numbers."""
    stored, group = manifest.get("expert_dtype"), manifest.get("expert_group", 0)
    wanted = stored if expert_dtype is None else expert_dtype
    if wanted != stored or (group_size is not None and group_size != group):
        raise InputError(f"{orbax_dir} stores its experts as {stored or manifest['dtype']}"
                         f"{f' (group {group})' if group else ''}, but expert_dtype={expert_dtype!r}"
                         f"{f', expert_group_size={group_size}' if group_size is not None else ''} was asked for; "
                         f"load it without expert_dtype, or convert the Hugging Face checkpoint again with "
                         f"--expert-dtype")
    return cfg.replace(expert_dtype=stored, expert_group=group)


def check_params(orbax_dir: Path, manifest: dict, abstract: dict[ParamPath, object], cfg: ModelConfig) -> None:
    """Every parameter the config asks for is in the manifest with its shape, and nothing else is."""
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


def restore_model(orbax_dir: str | Path, cfg: ModelConfig, *, dtype=None, sharding_of: ShardingOf | None = None,
                  progress: bool = True, unread=None) -> MoETransformer:
    """Restore a converted checkpoint into a MoETransformer, each array directly where it will live.

    dtype: parameter dtype (default: the dtype the checkpoint was converted to).
    sharding_of: jmoe parameter path, e.g. ("layers", 3, "mlp", "experts", "w_down") -> its sharding (memory
        kind "device" or "pinned_host"; split over an expert mesh); default: everything on the device.
    """
    orbax_dir = Path(orbax_dir).absolute()  # Orbax works on absolute paths only
    manifest = read_manifest(orbax_dir)
    dtype = np.dtype(jnp.dtype(dtype or manifest["dtype"]))
    cfg = converted_expert_dtype(orbax_dir, manifest, cfg, cfg.expert_dtype, None)
    graphdef, state = abstract_model(cfg, dtype)
    abstract = flat_params(nnx.to_pure_dict(state))
    check_params(orbax_dir, manifest, abstract, cfg)
    # `unread(path)` True: not restored, and holding no expert (experts the disk tier reads itself).
    loaded = {path: jax.device_put(np.zeros((0, *abstract[path].shape[1:]), abstract[path].dtype),
                                   sharding_of(path) if sharding_of else sharding_for(DEVICE))
              for path in abstract if unread is not None and unread(path)}
    ocp = orbax()
    load_context = ocp.Context()
    load_context.pytree.loading.partial_load = True  # one group at a time
    with load_context, tqdm(total=len(abstract) - len(loaded), desc="restoring", unit="param", disable=not progress,
                            leave=False) as bar:
        for group, paths in param_groups(abstract).items():
            paths = [path for path in paths if path not in loaded]
            if not paths:
                continue
            targets = {}
            for path in paths:
                targets[orbax_key(path)] = jax.ShapeDtypeStruct(
                    abstract[path].shape, abstract[path].dtype,
                    sharding=sharding_of(path) if sharding_of else sharding_for(DEVICE))
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
                loaded[path] = flat[orbax_key(path)]
            # Parameters restored as stored have the bytes the checksums cover.
            verify_checksums(orbax_dir, manifest, {
                param_key(p): loaded[p] for p in paths
                if np.dtype(abstract[p].dtype) == np.dtype(stored_dtype(manifest, manifest["params"][param_key(p)]))})
            bar.update(len(paths))
    nnx.replace_by_pure_dict(state, nest_params(loaded))
    return nnx.merge(graphdef, state)
