import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile in fresh processes and must not write into the user's cache; tests of the cache set their own.
os.environ.setdefault("JMOE_COMPILE_CACHE", "off")

import pytest

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
