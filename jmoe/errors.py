"""Error types jmoe raises for bad user input.

Every message says what was expected, what was found, and what to change.
"""


class JmoeError(ValueError):
    """Base class: a user-facing problem with a model directory, an argument or an input."""


class ConfigError(JmoeError):
    """config.json is missing, unreadable or describes something jmoe does not support."""


class CheckpointError(JmoeError):
    """A weights file is missing, unsafe, corrupted, or does not match the config."""


class InputError(JmoeError):
    """A prompt, token id or generation argument is out of range."""


class NonFiniteError(JmoeError):
    """A generation step produced NaN or infinite activations (broken weights or inputs)."""


class InsufficientMemoryError(JmoeError):
    """The model, placed as asked, does not fit the memory available (jmoe.load's check before reading weights)."""
