"""Rebuild the vendored traces in this folder from the full trace files (see README.md).

    python bench/data/reduce_traces.py /path/to/traces   # folder holding gptoss20b_decode.npz etc.

GPT-OSS: keep the chosen expert ids (rank order unchanged) and the per-sequence metadata, drop
the gate probabilities (the replay does not use them; they are two thirds of the bytes).
OLMoE / Kimi: copied unchanged.
"""

import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
KEEP = ["expert_ids", "seq_offsets", "dataset", "category", "path", "finished",
        "has_repetition", "row_index", "prompt_len", "n_generated"]


def main(src: str) -> None:
    src_dir = Path(src)
    full = np.load(src_dir / "gptoss20b_decode.npz")
    np.savez_compressed(HERE / "gptoss20b_decode_ids.npz", **{k: full[k] for k in KEEP})
    for name in ["olmoe_1b7b_decode_299.npy", "kimi_linear_48b_decode_300.npy"]:
        shutil.copyfile(src_dir / name, HERE / name)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/data/reduce_traces.py <folder with gptoss20b_decode.npz>")
    main(sys.argv[1])
