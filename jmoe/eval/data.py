"""Evaluation data files -> one 1-D token stream, chosen by the file's extension.

- `.npy`: a 1-D integer NumPy array of token ids (any integer dtype, e.g. uint16).
- `.ids`: token ids as decimal integers separated by whitespace; lines are concatenated in order.
- text (`.txt`, `.text`, `.md`, `.rst`, `.py`): UTF-8, encoded as one string with the model's
  tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmoe.errors import InputError
from jmoe.checkpoint.tokenizer import TextTokenizer

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
TOKEN_SUFFIXES = (".npy", ".ids")


def check_data_path(path: Path) -> str:
    """The format of `path` ("npy", "ids" or "text"), or an InputError if it is missing or unknown."""
    if not path.is_file():
        found = "a directory" if path.is_dir() else "nothing"
        raise InputError(f"--data {path}: expected a data file, found {found} there; pass an existing file")
    suffix = path.suffix.lower()
    if suffix in TOKEN_SUFFIXES:
        return suffix[1:]
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise InputError(f"--data {path}: unknown data format {suffix or '(no extension)'!r}; expected token ids "
                     f"({', '.join(TOKEN_SUFFIXES)}) or text ({', '.join(TEXT_SUFFIXES)}); rename the file "
                     f"to say which")


def read_tokens(path: str | Path, tokenizer: TextTokenizer | None) -> np.ndarray:
    """The token stream of a data file as int64 [N] (not yet checked against a vocabulary)."""
    path = Path(path)
    kind = check_data_path(path)
    if kind == "npy":
        return _read_npy(path)
    if kind == "ids":
        return _read_ids(path)
    if tokenizer is None:
        raise InputError(f"--data {path}: a text file needs the model's tokenizer.json, found none in the model "
                         f"directory; add one, or pass token ids ({', '.join(TOKEN_SUFFIXES)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--data {path}: expected UTF-8 text, found invalid byte at offset {e.start}") from e
    return np.asarray(tokenizer.encode(text), np.int64)


def _read_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise InputError(f"--data {path}: cannot read as a .npy array ({e})") from e
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"--data {path}: expected a 1-D integer array of token ids, found {arr.dtype} "
                         f"{arr.shape}; save the stream flattened with an integer dtype")
    return arr.astype(np.int64)


def _read_ids(path: Path) -> np.ndarray:
    ids = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            for word in line.split():
                try:
                    ids.append(int(word))
                except ValueError:
                    raise InputError(f"--data {path}: line {line_no}: expected whitespace-separated integer "
                                     f"token ids, found {word[:40]!r}") from None
    return np.asarray(ids, np.int64)
