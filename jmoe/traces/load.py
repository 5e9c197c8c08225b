"""Routing traces on disk: which files there are, loading, validation and the tuning/report splits, and their
first tokens written out as a small stand-in (``write_trace_starts``).

A trace is the expert ids a model chose while decoding, ``expert_ids`` int [tokens, layers, k].
The traces ship in the repository's ``bench/data`` (provenance in its README). GPT-OSS holds
many sequences from several datasets: static tables, LFRU constants and predictor tables come
from the ``mmlu*`` sequences (the tuning split), results are reported on the rest. OLMoE and
Kimi hold one prompt each: tuning uses the first half of the tokens, reports the second.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmoe.errors import JmoeError
from jmoe.offload.policies import expert_counts

# jmoe is installed editable from its repository (pyproject.toml), so the traces are found next
# to the package: <repo>/bench/data. A copy installed elsewhere has no traces; pass data_dir.
DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "data"
TRACE_FILES = {
    "gptoss": "gptoss20b_decode_ids.npz",
    "olmoe": "olmoe_1b7b_decode_299.npy",
    "kimi": "kimi_linear_48b_decode_300.npy",
}
TRACE_MODELS = {  # name -> (model, experts per layer)
    "gptoss": ("GPT-OSS-20B", 32),
    "olmoe": ("OLMoE-1B-7B-0924", 64),
    "kimi": ("Kimi-Linear-48B", 256),
}
TUNING_PREFIX = "mmlu"  # GPT-OSS datasets whose sequences form the tuning split
# The cross-layer predictor table fitted on the GPT-OSS mmlu* sequences (provenance inside;
# jmoe.traces.tuning.fit_table writes it).
CROSSLAYER_TABLE = DATA_DIR / "gptoss20b_crosslayer_mmlu.npz"


class TraceError(JmoeError):
    """A trace, a trace slice or a replay argument that does not fit: the message says what was
    expected, what was found and what to change."""


def frequency_table(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [L, E]: how many tokens of ``expert_ids`` [T, L, k] used each expert of each layer."""
    return expert_counts(np.swapaxes(np.asarray(expert_ids), 0, 1), num_experts)


def check_trace(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Validate a trace [T, L, k] of expert ids; returns it as int64."""
    expert_ids = np.asarray(expert_ids)
    if expert_ids.ndim != 3 or expert_ids.shape[0] == 0:
        raise TraceError(
            f"expected a trace of expert ids shaped [tokens, layers, k] with at least one token, "
            f"found shape {list(expert_ids.shape)}"
        )
    if not np.issubdtype(expert_ids.dtype, np.integer):
        raise TraceError(f"expected integer expert ids, found dtype {expert_ids.dtype}")
    expert_ids = expert_ids.astype(np.int64)
    if expert_ids.min() < 0 or expert_ids.max() >= num_experts:
        raise TraceError(
            f"expected expert ids in [0, {num_experts}), found range "
            f"[{expert_ids.min()}, {expert_ids.max()}]; check num_experts"
        )
    ranked = np.sort(expert_ids, axis=2)
    if (ranked[:, :, 1:] == ranked[:, :, :-1]).any():
        raise TraceError("expected the k expert ids of a (token, layer) to be distinct, found repeats")
    return expert_ids


def load_trace(name: str, data_dir: Path = DATA_DIR) -> dict:
    """{"expert_ids" [T, L, k], "num_experts", and for gptoss "seq_offsets", "dataset"}."""
    if name not in TRACE_FILES:
        raise TraceError(
            f"unknown trace {name!r}; expected one of {', '.join(TRACE_FILES)} (--trace)"
        )
    path = Path(data_dir) / TRACE_FILES[name]
    if not path.exists():
        raise TraceError(f"trace file {path} not found; it ships in bench/data (see its README)")
    trace = {"name": name, "model": TRACE_MODELS[name][0], "num_experts": TRACE_MODELS[name][1]}
    if name == "gptoss":
        with np.load(path) as data:
            trace["expert_ids"] = data["expert_ids"]
            trace["seq_offsets"] = data["seq_offsets"]
            trace["dataset"] = data["dataset"].astype(str)
    else:
        trace["expert_ids"] = np.load(path)
    return trace


def write_trace_starts(data_dir: Path, sequences: int, tokens: int) -> Path:
    """``data_dir`` (created) holding the start of every trace in DATA_DIR, as the same files: for gptoss the first
    ``sequences`` sequences of each dataset, each cut to ``tokens`` tokens; for the one-prompt traces the first
    2 x ``tokens`` tokens (their tuning and report halves). A stand-in for DATA_DIR in a few tokens."""
    data_dir.mkdir(parents=True)
    for name, file in TRACE_FILES.items():
        trace = load_trace(name)
        if name != "gptoss":
            np.save(data_dir / file, trace["expert_ids"][:2 * tokens])
            continue
        offsets, names = trace["seq_offsets"], trace["dataset"]
        keep = np.concatenate([np.flatnonzero(names == dataset)[:sequences] for dataset in np.unique(names)])
        keep.sort()
        rows = [trace["expert_ids"][offsets[i]:min(offsets[i + 1], offsets[i] + tokens)] for i in keep]
        np.savez(data_dir / file, expert_ids=np.concatenate(rows), dataset=names[keep],
                 seq_offsets=np.concatenate([[0], np.cumsum([len(r) for r in rows])]))
    return data_dir


def sequence_rows(trace: dict, keep: np.ndarray) -> np.ndarray:
    """Rows of the sequences marked in ``keep`` (bool per sequence), in file order."""
    offsets = trace["seq_offsets"]
    starts, stops = offsets[:-1][keep], offsets[1:][keep]
    if len(starts) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])


def split_trace(trace: dict, datasets: list[str] | None = None) -> dict:
    """Choose the rows to report on and the rows static tables come from.

    gptoss: report on ``datasets`` (default: every dataset not starting with "mmlu"); tune on
    the mmlu* sequences. olmoe/kimi: tune on the first half of the tokens, report on the second.
    """
    ids = trace["expert_ids"]
    if trace["name"] != "gptoss":
        if datasets:
            raise TraceError(
                f"--datasets applies to --trace gptoss only; the {trace['name']} trace is one "
                f"prompt with no dataset names: drop --datasets"
            )
        half = len(ids) // 2
        return {
            "eval_ids": ids[half:],
            "tune_ids": ids[:half],
            "eval_desc": f"tokens {half}..{len(ids) - 1} (second half)",
            "tune_desc": f"tokens 0..{half - 1} (first half)",
            "overlap": False,
        }
    names = trace["dataset"]
    available = sorted(set(names.tolist()))
    tuning = np.char.startswith(names, TUNING_PREFIX)
    if datasets:
        unknown = [d for d in datasets if d not in available]
        if unknown:
            raise TraceError(
                f"unknown dataset(s) {', '.join(unknown)} for --datasets; available: "
                f"{', '.join(available)}"
            )
        keep = np.isin(names, datasets)
        eval_desc = "datasets " + ",".join(datasets)
    else:
        keep = ~tuning
        eval_desc = f"held-out split (datasets not starting with {TUNING_PREFIX!r})"
    return {
        "eval_ids": ids[sequence_rows(trace, keep)],
        "tune_ids": ids[sequence_rows(trace, tuning)],
        "eval_desc": eval_desc,
        "tune_desc": f"tuning split (datasets starting with {TUNING_PREFIX!r})",
        "overlap": bool((keep & tuning).any()),
    }


def tuning_sample(trace: dict, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample, rest): bool per sequence of a gptoss trace; ``sample`` holds one in ``stride``
    mmlu* sequences in file order, ``rest`` the other mmlu* sequences. No held-out sequence is
    in either."""
    mmlu = np.flatnonzero(np.char.startswith(trace["dataset"], TUNING_PREFIX))
    sample = np.zeros(len(trace["dataset"]), dtype=bool)
    sample[mmlu[::stride]] = True
    rest = np.zeros_like(sample)
    rest[mmlu] = True
    rest &= ~sample
    return sample, rest
