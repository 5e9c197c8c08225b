"""The corpus: the Python standard library's own *.py sources on this machine.

Test directories (`test`, `tests`, `idle_test`) and third-party packages (`site-packages`,
`dist-packages`) are excluded. Files are listed in sorted order of their path relative to the stdlib
root; a file is held out for validation when the SHA-256 of that relative path is 0 mod 20 (about 5%,
stable if files are added or removed). Files that are not valid UTF-8 are skipped and counted.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
VALIDATION_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel_path: str) -> bool:
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % VALIDATION_MODULUS == 0


@dataclass
class Split:
    names: list[str]  # paths relative to the stdlib root, sorted
    texts: list[str]


@dataclass
class Corpus:
    root: Path
    train: Split
    validation: Split
    skipped_non_utf8: list[str]

    def summary(self) -> dict:
        return {
            "source": f"CPython standard library *.py files under {self.root}",
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "validation_rule": f"sha256(relative path) % {VALIDATION_MODULUS} == 0",
            "train_files": len(self.train.names),
            "train_chars": sum(map(len, self.train.texts)),
            "validation_files": len(self.validation.names),
            "validation_chars": sum(map(len, self.validation.texts)),
            "skipped_non_utf8": self.skipped_non_utf8,
        }


def load_corpus(root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory {root} does not exist")
    paths = sorted((p for p in root.rglob("*.py")
                    if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    train, validation, skipped = Split([], []), Split([], []), []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        split = validation if is_validation(rel) else train
        split.names.append(rel)
        split.texts.append(text)
    if not train.names or not validation.names:
        raise ValueError(f"{root}: found {len(train.names)} training and {len(validation.names)} validation "
                         f"files; both splits must be non-empty")
    return Corpus(root, train, validation, skipped)
