"""jmoe: run Mixture-of-Experts language models in JAX on an accelerator too small to hold them."""

from jmoe.api import Model, load, random_model
from jmoe.config import ModelConfig, load_config, parse_config
from jmoe.errors import CheckpointError, ConfigError, InputError, InsufficientMemoryError, JmoeError, NonFiniteError
from jmoe import plan  # a callable package: jmoe.plan(path, ...) plans a model's memory (see jmoe.plan)

__all__ = ["Model", "load", "random_model", "plan", "ModelConfig", "load_config", "parse_config",
           "JmoeError", "ConfigError", "CheckpointError", "InputError", "InsufficientMemoryError", "NonFiniteError"]
