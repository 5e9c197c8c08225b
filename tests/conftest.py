import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile in fresh processes and must not write into the user's cache; tests of the cache set their own.
os.environ.setdefault("JMOE_COMPILE_CACHE", "off")

# Compiling dominates this suite's time (tiny models, many programs). jmoe.compile_cache.FAST_COMPILE_XLA_FLAGS
# (as the bench smoke runs use them) halve LLVM's share of it: the same HLO programs (HLO passes, copies and fusion
# are unchanged; what the tests' HLO checks read), only their machine code less optimized. They hold for this process
# only: XLA reads XLA_FLAGS once, at its first compile, which happens here; the variable is then restored, so child
# processes (GPU-target compile workers, bench runs) compile as they would outside the tests unless a test asks.
from jmoe.compile_cache import with_fast_compile  # noqa: E402

_xla_flags = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = with_fast_compile(_xla_flags)
try:
    import jax

    jax.jit(lambda x: x + 1)(1).block_until_ready()
finally:
    if _xla_flags is None:
        os.environ.pop("XLA_FLAGS")
    else:
        os.environ["XLA_FLAGS"] = _xla_flags

import pytest

import shutil

from hf_models import FAMILY_CASES, write_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (checkpoint directory, the transformers model that wrote it), for every family case."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(FAMILY_CASES.items()):
        directory = root / name
        out[name] = (directory, write_checkpoint(directory, model_type, seed=i, **overrides))
    return out


@pytest.fixture(scope="session")
def small_mixtral_dir(tmp_path_factory):
    """A tiny Mixtral checkpoint (4 experts, top-2) without a tokenizer, for tests that break copies of it."""
    directory = tmp_path_factory.mktemp("small") / "m"
    write_checkpoint(directory, "mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                     num_attention_heads=2, num_key_value_heads=1)
    return directory


@pytest.fixture
def small_mixtral_copy(small_mixtral_dir, tmp_path):
    """A fresh copy of small_mixtral_dir that a test may change."""
    directory = tmp_path / "m"
    shutil.copytree(small_mixtral_dir, directory)
    return directory
