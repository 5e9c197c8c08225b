"""What a checkpoint holds, from its headers alone: config.json, the safetensors headers or the manifest of a
jmoe Orbax checkpoint. No tensor data is read, so this works on a checkpoint whose data is missing or cut
off, and `jmoe.load` runs it to check memory before it reads any weight.

The parameter dtype and the abstract parameters are decided exactly as loading decides them, so the
placement planned from them is the placement `jmoe.load` makes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np

from jmoe.arguments import param_dtype
from jmoe.checkpoint.bounds import check_sizes_against_tensors
from jmoe.checkpoint.loading import param_pieces, params_as_read
from jmoe.checkpoint.orbax_store import (check_params, converted_expert_dtype, is_orbax_checkpoint, read_manifest,
                                         stored_dtype)
from jmoe.checkpoint.safetensors_files import stored_values, tensor_stored_bytes
from jmoe.config import ModelConfig, load_config, with_expert_dtype
from jmoe.errors import ConfigError, InputError
from jmoe.model.params import ParamPath, abstract_params


@dataclasses.dataclass(frozen=True)
class CheckpointHeaders:
    directory: Path
    config: ModelConfig
    format: str  # "safetensors" | "jmoe-orbax"
    dtype: np.dtype  # the parameter dtype loading uses
    abstract: dict[ParamPath, object]  # every parameter's shape and dtype, as loading will hold it
    stored_tensors: int  # tensors in the checkpoint
    stored_bytes: int  # bytes of tensor data the headers describe (in the checkpoint's own dtypes)
    stored_dtypes: dict[str, int]  # checkpoint dtype -> tensors of it

    def as_dict(self) -> dict:
        return {"directory": str(self.directory), "format": self.format, "param_dtype": self.dtype.name,
                "stored_tensors": self.stored_tensors, "stored_bytes": self.stored_bytes,
                "stored_dtypes": self.stored_dtypes}


def read_headers(model_dir: str | Path, dtype=None, expert_dtype: str | None = None,
                 expert_group_size: int | None = None) -> CheckpointHeaders:
    """Config and headers of the checkpoint in `model_dir`, checked against each other (every expected tensor
    present with its shape, nothing unexpected), as `jmoe.load` checks them. `dtype`, `expert_dtype` and
    `expert_group_size` override the checkpoint's like jmoe.load's."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    if is_orbax_checkpoint(model_dir):
        manifest = read_manifest(model_dir)
        # An Orbax checkpoint keeps the dtype and expert format it was converted to.
        dtype = param_dtype(dtype or manifest["dtype"])
        config = converted_expert_dtype(model_dir, manifest, config, expert_dtype, expert_group_size)
        shapes = [entry["shape"] for entry in manifest["params"].values()]
        check_sizes_against_tensors(model_dir, config, sum(int(np.prod(s, dtype=np.int64)) for s in shapes))
        abstract = abstract_params(config, dtype)
        check_params(model_dir, manifest, abstract, config)
        stored = Counter()
        stored_bytes = 0
        for entry in manifest["params"].values():
            entry_dtype = np.dtype(stored_dtype(manifest, entry))
            stored[entry_dtype.name] += 1
            stored_bytes += int(np.prod(entry["shape"])) * entry_dtype.itemsize
        return CheckpointHeaders(model_dir, config, "jmoe-orbax", dtype, abstract, len(shapes), stored_bytes,
                                 dict(stored))
    # A Hugging Face checkpoint says its dtype in config.json.
    if dtype is None:
        try:
            dtype = param_dtype(config.dtype)
        except InputError as e:
            raise ConfigError(f"{model_dir / 'config.json'}: {e}") from None
    else:
        dtype = param_dtype(dtype)
    config = with_expert_dtype(config, expert_dtype, expert_group_size)
    check_sizes_against_tensors(model_dir, config, stored_values(model_dir))
    abstract = abstract_params(config, dtype)
    pieces = param_pieces(model_dir, config, params_as_read(config, dtype), check_data=False)
    infos = [info for path_pieces in pieces.values() for _, info in path_pieces]
    return CheckpointHeaders(model_dir, config, "safetensors", dtype, abstract, len(infos),
                             sum(tensor_stored_bytes(info) for info in infos),
                             dict(Counter("MXFP4" if i.mx_blocks is not None else i.dtype for i in infos)))
