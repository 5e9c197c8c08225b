"""MXFP4 expert checkpoints (GPT-OSS: `quantization_config.quant_method: mxfp4`).

A stacked expert weight `W` [E, K, N] (as the float checkpoint stores it, input axis K) ships as
`W_blocks` uint8 [E, N, K/32, 16] and `W_scales` uint8 [E, N, K/32]: for each output column n and group of 32
input rows, 16 bytes of e2m1 codes (value 2i in the low nibble, 2i + 1 in the high one) and one e8m0 scale,
2^(byte - 127). Reading one gives W dequantized in float32, [E, K, N]; with `expert_dtype` "mxfp4" (the
default for these checkpoints) loading quantizes it again with jmoe's own layout, which reproduces every
value exactly (jmoe.kernels.quantized picks the scale that puts the group maximum in [4, 6]; the other codes
then only double, and e2m1 is closed under doubling up to 6).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmoe.errors import CheckpointError

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def attach_mxfp4(model_dir: Path, tensors: dict, quantized: bool) -> dict:
    """The checkpoint's tensors with each `X_blocks` / `X_scales` pair replaced by one entry `X` that reads as
    the dequantized weight (its TensorInfo carries the pair); checks shapes and dtypes."""
    from jmoe.checkpoint.safetensors_files import TensorInfo

    def refuse(name: str, why: str, fix: str):
        raise CheckpointError(f"{tensors[name].file}: tensor {name!r} {why}; {fix}")

    out = {name: info for name, info in tensors.items() if not name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))}
    for name, blocks in tensors.items():
        if name.endswith(SCALES_SUFFIX) and name[:-len(SCALES_SUFFIX)] + BLOCKS_SUFFIX not in tensors:
            refuse(name, "is an MXFP4 scale of no blocks tensor", "the checkpoint is incomplete: download it again")
        if not name.endswith(BLOCKS_SUFFIX):
            continue
        base = name[:-len(BLOCKS_SUFFIX)]
        if not quantized:
            refuse(name, "holds MXFP4 blocks but config.json has no quantization_config", "use the config.json the "
                   "weights were saved with (quant_method mxfp4)")
        scales = tensors.get(base + SCALES_SUFFIX)
        if scales is None:
            refuse(name, f"has no scales {base + SCALES_SUFFIX!r}", "the checkpoint is incomplete: download it again")
        if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[-1] != 16:
            refuse(name, f"is {blocks.dtype} {list(blocks.shape)}, expected U8 [E, N, K/32, 16]", "re-export it")
        if scales.dtype != "U8" or scales.shape != blocks.shape[:-1]:
            refuse(base + SCALES_SUFFIX, f"is {scales.dtype} {list(scales.shape)}, expected U8 "
                   f"{list(blocks.shape[:-1])} (one per 16 bytes of {name!r})", "re-export the checkpoint")
        experts, columns, groups, _ = blocks.shape
        info = TensorInfo(blocks.file, "F32", (experts, groups * 32, columns), blocks.start, blocks.end)
        info.mx_blocks, info.mx_scales = blocks, scales
        out[base] = info
    return out


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[E, N, K/32, 16] codes and [E, N, K/32] scales -> float32 [E, K, N], one expert at a time."""
    experts, columns, groups, _ = blocks.shape
    out = np.empty((experts, groups * 32, columns), np.float32)
    for e in range(experts):
        codes = np.stack([blocks[e] & 15, blocks[e] >> 4], axis=-1).reshape(columns, groups, 32)
        values = _E2M1[codes] * np.exp2(scales[e].astype(np.float32) - 127)[..., None]
        out[e] = values.reshape(columns, groups * 32).T
    return out
