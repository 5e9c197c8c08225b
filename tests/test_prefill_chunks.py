"""jmoe.offload.prefill_chunks: the prefill chunk of a long prompt where offloaded experts stream, on the published
shape of Mixtral-8x7B (bf16, no weights: shapes only)."""

import pytest

from bench.plan import MODELS
from jmoe.config import parse_config
from jmoe.model.params import abstract_params
from jmoe.offload import prefill_chunks as pc
from jmoe.offload.expert_parallel import device_placement
from jmoe.offload.options import OffloadOptions

H100_LINK, H100_BF16 = 63e9, 989.4e12  # jmoe/plan/targets/speeds.json


@pytest.fixture(scope="module")
def mixtral():
    cfg = parse_config(MODELS["mixtral-8x7b"])
    return cfg, abstract_params(cfg, "bfloat16")


def placed(mixtral, cache=None, devices=1, **options):
    """One device's placement, as jmoe.load makes it (under expert parallelism, of its E / devices experts)."""
    cfg, params = mixtral
    return device_placement(cfg, params, OffloadOptions(cache, **options), devices)


@pytest.mark.quick
def test_the_chunk_is_the_shortest_power_of_two_whose_compute_outlasts_the_stream():
    assert pc.chunk_length(512.0, 0.5, 4096) == 1024  # exactly 1024 tokens of compute
    assert pc.chunk_length(512.5, 0.5, 4096) == 2048  # one token more: the next power of two
    assert pc.chunk_length(1025.0, 0.5, 8192) == 4096  # the stream twice as long: twice the chunk
    assert pc.chunk_length(0.001, 0.5, 4096) == pc.SMALL_CHUNK == 256  # never shorter than the server's own chunks
    assert pc.chunk_length(1e6, 0.5, 4096) == 4096  # capped at the context, a power of two or not
    assert pc.chunk_length(1e6, 0.5, 3000) == 3000 and pc.chunk_length(0.0, 0.5, 100) == 100


def test_mixtral_at_cache_4_streams_45_gb_a_chunk_and_takes_the_whole_prompt_on_an_h100(mixtral):
    cfg, params = mixtral
    placement = placed(mixtral, 4)
    expert = 3 * 4096 * 14336  # gate, up and down of one expert
    assert placement.expert_bytes == 2 * expert
    # 32 layers x the 4 experts of 8 no slot holds
    assert pc.chunk_stream_bytes(placement, 8) == 32 * 4 * 2 * expert == pytest.approx(45.1e9, rel=1e-3)
    # per layer: q and o 4096 x 4096, k and v 4096 x 1024, the router 4096 x 8, two norms; then the final norm and
    # the lm head; the embedding is a lookup; and 2 of 8 experts in each of the 32 layers
    dense = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 4096) + 4096 + 32000 * 4096
    assert pc.prefill_flops_per_token(cfg, params) == 2 * (dense + 32 * 2 * expert) == pytest.approx(25.5e9, rel=1e-3)
    # 45.1 GB at 0.8 x 63 GB/s: 0.89 s; 25.5 GFLOP a token at 0.8 x 989.4 TFLOP/s: 32 us; 27.8k tokens -> 32768
    assert pc.prefill_chunk_for(placement, cfg, params, platform="gpu", context=32768, link_bytes_per_s=H100_LINK,
                                peak_flops=H100_BF16) == 32768
    assert pc.prefill_chunk_for(placement, cfg, params, platform="gpu", context=4096, link_bytes_per_s=H100_LINK,
                                peak_flops=H100_BF16) == 4096
    # a link 16 times as fast: 1.7k tokens -> 2048; the defaults (PCIe 4.0, an H100's peak) give a longer chunk
    assert pc.prefill_chunk_for(placement, cfg, params, platform="gpu", context=32768, link_bytes_per_s=16 * H100_LINK,
                                peak_flops=H100_BF16) == 2048
    assert pc.prefill_chunk_for(placement, cfg, params, platform="gpu", context=1 << 20) == 1 << 16
    # split over 2 GPUs: each streams its share (2 of its 4 experts) over its own link, computes its experts' share
    one_gpu = placed(mixtral, 2, devices=2)
    assert pc.chunk_stream_bytes(one_gpu, 4) == 32 * 2 * 2 * expert
    assert pc.prefill_flops_per_token(cfg, params, devices=2) == 2 * (dense + 32 * expert)


def test_nothing_streams_on_a_cpu_or_with_every_weight_on_the_device(mixtral):
    cfg, params = mixtral
    offloaded, resident = placed(mixtral, 4), placed(mixtral)
    attention_on_host = placed(mixtral, offload_params=["attn"])

    def chunk(placement, platform):
        return pc.prefill_chunk_for(placement, cfg, params, platform=platform, context=4096,
                                    link_bytes_per_s=H100_LINK, peak_flops=H100_BF16)

    assert chunk(offloaded, "cpu") is None and not pc.prefill_streams(offloaded, "cpu")  # experts read in place
    assert chunk(resident, "gpu") is None and not pc.prefill_streams(resident, "gpu")
    # host-kept attention weights stream into every step: 32 layers of q, k, v, o, and nothing else
    assert pc.prefill_streams(attention_on_host, "gpu") and not attention_on_host.offloaded_layers
    assert pc.chunk_stream_bytes(attention_on_host, 8) == 32 * 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert chunk(attention_on_host, "gpu") == 2048  # 2.7 GB at 50.4 GB/s: 53 ms, 1.7k tokens' compute
