"""The suite's compile options (tests/conftest.py): every test compiles with the fast XLA:CPU flags, and a test marked
`cpu_hlo` gets the very program a process without them compiles, so what it reads of the HLO holds for users."""

import os
import re
import subprocess
import sys

import pytest

PROGRAM = """
import jax, jax.numpy as jnp
print(jax.jit(lambda x, i: x.at[i].add(1.0)).lower(jnp.zeros(8), jnp.array([1, 3])).compile().as_text())
"""


def instructions(hlo_text: str) -> str:
    """The program without its source locations (they name the process's own frames)."""
    return re.sub(r", metadata=\{[^}]*\}", "", hlo_text.split("\nFileNames")[0]).strip()


def scatter_program() -> str:
    """The optimized HLO of a small scatter, compiled in this process."""
    namespace = {}
    exec(PROGRAM.replace("print(", "result = ("), namespace)
    return namespace["result"]


@pytest.mark.quick
def test_the_suite_compiles_with_the_fast_flags():
    assert " scatter(" not in scatter_program()  # XLA's LLVM IR emitters turn a scatter into a loop


@pytest.mark.quick
@pytest.mark.cpu_hlo
def test_a_cpu_hlo_test_compiles_the_program_users_get():
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    users = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=120)
    assert users.returncode == 0, users.stderr
    assert " scatter(" in users.stdout
    assert instructions(scatter_program()) == instructions(users.stdout)
