"""Checks of user-given arguments, shared by the API and the command lines: each returns the value in its
canonical type or raises InputError naming the argument, what it must be and what was found."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

from jmoe.errors import InputError
from jmoe.kernels import BACKENDS, FORMATS

PARAM_DTYPES = ("float32", "bfloat16")  # what the expert kernels compute in
EXPERT_DTYPES = (*PARAM_DTYPES, *FORMATS)  # how routed experts may be stored


def is_whole_number(value) -> bool:
    """An integer of any integer type, and not a boolean (booleans are not counts)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole_number(name: str, value, minimum: int = 0, meaning: str = "") -> int:
    """`value` as an int >= minimum; `meaning` says in the error what the number counts."""
    if not is_whole_number(value) or value < minimum:
        raise InputError(f"{name} must be a whole number >= {minimum}{f' ({meaning})' if meaning else ''}, "
                         f"found {value!r}")
    return int(value)


def positive_finite(name: str, value) -> float:
    """`value` as a float > 0 that is neither inf nor NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a finite number > 0, found {value!r}")
    return float(value)


def checked_expert_dtype(expert_dtype):
    """`expert_dtype` if it is None or one of EXPERT_DTYPES, else InputError."""
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise InputError(f"expert_dtype must be None or one of {', '.join(EXPERT_DTYPES)}, found {expert_dtype!r}; "
                         f"pass expert_dtype= / --expert-dtype with one of them")
    return expert_dtype


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, found {backend!r}")


def param_dtype(name) -> jnp.dtype:
    """The parameter dtype called `name`; float32 or bfloat16, what the expert kernels compute in."""
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in PARAM_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(PARAM_DTYPES)}, found {name!r}; pass dtype= / --dtype "
                         f"with one of them")
    return dtype

