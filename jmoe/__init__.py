"""jmoe: run Mixture-of-Experts language models in JAX on an accelerator too small to hold them."""

import importlib

from jmoe.errors import CheckpointError, ConfigError, InputError, InsufficientMemoryError, JmoeError, NonFiniteError

# Imported when first used (PEP 562): `import jmoe` stays cheap for the processes that need one part of it (a
# GPU-target compile worker, a command line's argument errors), and `from jmoe import load` works as before.
_LAZY = {"Model": "jmoe.api", "load": "jmoe.api", "random_model": "jmoe.api", "ModelConfig": "jmoe.config",
         "load_config": "jmoe.config", "parse_config": "jmoe.config"}

__all__ = ["Model", "load", "random_model", "plan", "ModelConfig", "load_config", "parse_config",
           "JmoeError", "ConfigError", "CheckpointError", "InputError", "InsufficientMemoryError", "NonFiniteError"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    # A subpackage, as `import jmoe` once made them all: jmoe.plan (a callable package: jmoe.plan(path, ...) plans a
    # model's memory), jmoe.api, ...
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
