"""Reading the JSON files of a model directory (config, generation config, index, manifest) with one
error style: the file, what it should be, what went wrong, and what to do about it."""

from __future__ import annotations

import json
from pathlib import Path

from jmoe.errors import JmoeError


def read_json(path: Path, what: str, error: type[JmoeError], advice: str) -> dict:
    """The parsed JSON object in `path`; `error` naming the file, `what` it is and `advice` otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: the {what} is not valid JSON ({e}); {advice}") from e
    if not isinstance(data, dict):
        raise error(f"{path}: the {what} must be a JSON object, found a {type(data).__name__}; {advice}")
    return data
