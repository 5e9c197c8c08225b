import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile in fresh processes and must not write into the user's cache; tests of the cache set their own.
os.environ.setdefault("JMOE_COMPILE_CACHE", "off")

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
