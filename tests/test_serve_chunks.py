"""How the serving engine cuts prompts into prefill chunks (jmoe.serve.chunks); the engine's tests check the tokens."""

from pathlib import Path

import pytest

import jmoe
from jmoe.serve import ServingEngine
from jmoe.serve import chunks
from jmoe.serve.chunks import CHUNK_BUCKETS, chunk_buckets, chunk_for

DEFAULT = Path(__file__).resolve().parents[1] / "checkpoints" / "default"


@pytest.mark.quick
def test_chunk_lengths_reach_the_longest_by_powers_of_two_and_a_continuing_piece_is_shorter_than_the_context():
    assert chunk_buckets(4096) == CHUNK_BUCKETS == (16, 64, 128, 192, 256)
    assert chunk_buckets(100) == (16, 64) and chunk_buckets(8) == (4,)
    assert chunk_buckets(4096, 4096) == (16, 64, 128, 192, 256, 512, 1024, 2048, 4096)
    assert chunk_buckets(4096, 3000) == (16, 64, 128, 192, 256, 512, 1024, 2048, 3000)
    assert chunk_buckets(4096, 100) == (16, 64, 100) and chunk_buckets(512, 8) == (8,)
    buckets = chunk_buckets(64, 64)
    assert buckets == (16, 32, 64)
    assert chunk_for(buckets, 40, False, 64) == 64  # a first piece reads none of the row's columns
    assert chunk_for(buckets, 40, True, 64) == 32  # one that continues cannot take the first-chunk program
    assert chunk_for(buckets, 5, True, 64) == 16


def test_the_longest_chunk_follows_whether_the_experts_stream(monkeypatch):
    """On a CPU an offloaded layer's prefill reads its experts in place: 256-token chunks at most. Where they stream
    per chunk (a GPU: the platform pretended here, no program compiled), the chunk grows to hide the stream; the
    default model's experts are so large next to its compute that the rule asks for more than the context."""
    offloaded = jmoe.load(DEFAULT, cache=4, progress=False)
    assert ServingEngine(offloaded, context=1024).chunks == CHUNK_BUCKETS
    assert ServingEngine(offloaded, context=1024, prefill_chunk=512).chunks == (*CHUNK_BUCKETS, 512)
    monkeypatch.setattr(chunks.jax, "default_backend", lambda: "gpu")
    assert ServingEngine(offloaded, context=1024).chunks == (*CHUNK_BUCKETS, 512, 1024)
    assert ServingEngine(jmoe.load(DEFAULT, progress=False), context=1024).chunks == CHUNK_BUCKETS  # all resident
