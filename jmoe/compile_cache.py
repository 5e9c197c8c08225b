"""JAX's persistent compilation cache in a user cache directory, so a second run of the same model and
shapes loads its compiled programs instead of compiling them again.

The cache is trusted code (JAX's warning): it lives in the user's own cache directory, created private
(mode 0700). A directory the user configured for JAX already is respected.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jmoe.errors import InputError

ENV_VAR = "JMOE_COMPILE_CACHE"  # a directory, or "off"
# XLA:CPU options for runs where compiling dominates and speed does not count (the tests and the benchmarks' smoke
# runs): less optimized machine code (the first two: the optimized HLO stays as it is), fusions emitted by XLA's LLVM IR
# emitters instead of its MLIR fusion emitters (this changes the optimized HLO: scatters become loops; the values stay),
# and the machine code generated as one module rather than in parts for parallel threads. A tiny OLMoE's 22 programs compiled in 11.2 s with XLA's defaults, 5.2 s with the
# first two, 1.8 s with all four (2-core Zen 3, 2026-11-28). For programs compiled for a GPU target (plans, the H100
# checks): ptxas without optimization (XLA:GPU runs it once per kernel, about 130 times for a tiny model's decode and
# prefill, 6 of their 20 s; the HLO and its memory are as before): a tiny plan's CPU time 7% lower.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1 "
                          "--xla_gpu_disable_gpuasm_optimizations=true")
# The fast options that change the optimized HLO, as compile options with XLA's defaults: a compile whose program
# must be the one users run (its copies, its temporaries) passes these.
DEFAULT_HLO_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": True}


def with_fast_compile(xla_flags: str | None) -> str:
    """An XLA_FLAGS value: `xla_flags` (the current value, or None) plus those of FAST_COMPILE_XLA_FLAGS it lacks."""
    flags = (xla_flags or "").split()
    return " ".join(flags + [flag for flag in FAST_COMPILE_XLA_FLAGS.split() if flag not in flags])


def default_directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jmoe" / "jax"


def enable_compile_cache(setting: bool | str | os.PathLike | None = None) -> Path | None:
    """Turn the persistent compilation cache on; returns its directory (None when off).

    setting: None = the JMOE_COMPILE_CACHE environment variable (a directory or "off"), else the default
    directory (~/.cache/jmoe/jax); True = the default directory; False = off; a path = that directory.
    """
    if setting is None:
        setting = os.environ.get(ENV_VAR) or True
    if setting is False or setting == "off":
        return None
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    if isinstance(setting, bool):
        directory = default_directory()
    elif isinstance(setting, (str, os.PathLike)):
        directory = Path(setting)
    else:
        raise InputError(f"compile_cache must be True, False or a directory, found {setting!r}")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"compile cache directory {directory} cannot be created ({e}); pass another "
                         f"directory or turn the cache off (compile_cache=False, --no-compile-cache)") from e
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Cache every program, however quick to compile: a second run then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory
