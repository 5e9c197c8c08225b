import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile in fresh processes and must not write into the user's cache; tests of the cache set their own.
os.environ.setdefault("JMOE_COMPILE_CACHE", "off")
# PyTorch (the reference) on one thread: beside the other xdist worker its threads spin-wait for each other (test_hf_parity
# and test_families took 10% more CPU with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiling dominates this suite's time (tiny models, many programs): jmoe.compile_cache.FAST_COMPILE_XLA_FLAGS (as the
# bench smoke runs use them) cut XLA:CPU's compiling to about a third, here and in every process a test starts (servers,
# expert-parallel and distributed children, GPU-target compile workers, where the XLA:CPU options change nothing).
# One of them changes the optimized HLO: tests that read an XLA:CPU program's structure are marked `cpu_hlo` and compile
# it as users do (`compile_as_users_do` below).
from jmoe.compile_cache import DEFAULT_HLO_COMPILE_OPTIONS, with_fast_compile  # noqa: E402

os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS"))

import pytest  # noqa: E402

import shutil  # noqa: E402

from hf_models import FAMILY_CASES, BuiltOnFirstUse, write_checkpoint  # noqa: E402


def pytest_collection_finish(session):
    """Every test module imported (JAX, jmoe, PyTorch, transformers): frozen out of the garbage collector's walks
    (jmoe.collector); in test_offload.py the collector's time went from 8.7 to 3.7 s of 161 s."""
    from jmoe.collector import freeze_loaded

    freeze_loaded()


@pytest.fixture(autouse=True)
def compile_as_users_do(request, monkeypatch):
    """In a test marked `cpu_hlo`, every program compiles with XLA's defaults for the fast options that change the
    optimized HLO (compile options override XLA_FLAGS), so the structure it reads is that of the program users run."""
    if request.node.get_closest_marker("cpu_hlo") is None:
        return
    from jax._src import compiler  # the one function every compile takes its options from

    original = compiler.get_compile_options

    def with_default_hlo(*args, **kwargs):
        options = original(*args, **kwargs)
        options.env_option_overrides = [*options.env_option_overrides, *DEFAULT_HLO_COMPILE_OPTIONS.items()]
        return options

    monkeypatch.setattr(compiler, "get_compile_options", with_default_hlo)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (checkpoint directory, the transformers model that wrote it), for every family case (each written when
    a test first reads it)."""
    root = tmp_path_factory.mktemp("hf")

    def write(name):
        model_type, overrides = FAMILY_CASES[name]
        return root / name, write_checkpoint(root / name, model_type, seed=list(FAMILY_CASES).index(name), **overrides)

    return BuiltOnFirstUse(write)


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


@pytest.fixture(scope="session")
def default_two_layers(tmp_path_factory):
    """The shipped default model's first two decoder layers (its widths, routers, tokenizer and chat template): for
    tests whose check holds at any depth, at half the compile time of its four."""
    from bench.helpers.common import DEFAULT_MODEL, write_first_layers

    directory = tmp_path_factory.mktemp("default") / "two_layers"
    write_first_layers(DEFAULT_MODEL, directory, 2)
    return directory
