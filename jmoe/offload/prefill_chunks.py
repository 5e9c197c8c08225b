"""How many prompt tokens one prefill chunk takes where an offloaded model's experts stream (issue #57).

On a GPU, a chunk's prefill copies every offloaded expert it needs that no cache slot holds from pinned host
memory, once per chunk (jmoe.offload.slots.stream_and_compute), and a chunk of even a few dozen tokens needs nearly
all of them: Mixtral-8x7B in bf16 at cache 4 of 8 streams about 45 GB a chunk, 0.9 s at 50 GB/s, whether the
chunk holds 16 tokens or 4,096. A long prompt is therefore cut into chunks long enough that streaming costs no
more than computing the chunk, up to the whole prompt. On a CPU prefill reads the experts where they live
(`experts_in_place`): nothing streams, and the serving engine's small chunks stay.

The rule (`chunk_length`): the fewest tokens whose compute takes as long as the stream, rounded up to a power of
two of at least SMALL_CHUNK, capped at the context. Powers of two keep the chunk lengths, hence the compiled
prefill programs, few and stable: a link speed given or measured a little differently next time rounds to the
same chunk, and the persistent compilation cache still holds its program. The rounding at most doubles the
chunk, which only hides the stream further.
"""

from __future__ import annotations

import math

from jmoe.config import ModelConfig
from jmoe.memory import PINNED_HOST
from jmoe.offload.placement import Placement

# The serving engine's longest chunk (jmoe/serve/chunks.py CHUNK_BUCKETS): a prompt is cut into pieces this long
# where nothing streams, and a streaming chunk is never shorter.
SMALL_CHUNK = 256
# Achieved shares of the nominal rates. The link: in-program copies of whole experts reached 49.5 of PCIe 5.0
# x16's 63 GB/s on the lent H100 (bench/results/gpu_check_nvidia_h100_80gb_hbm3.md). Compute: the fast end of
# jmoe.plan's MoE GEMM range (jmoe/plan/estimate.py COMPUTE_EFFICIENCY): the chunk hides the stream even when the
# GEMMs run at their best.
LINK_FRACTION = 0.8
COMPUTE_FRACTION = 0.8
# Nominal rates when the caller has none (a real GPU whose link was neither given nor measured). Both err towards
# a longer chunk, which still hides the stream on a faster link or a slower GPU: PCIe 4.0 x16, the slowest host
# link of jmoe.plan's targets, and an H100's dense bf16 peak, the fastest compute among them.
DEFAULT_LINK_BYTES_PER_S = 31.5e9
DEFAULT_PEAK_FLOPS = 989.4e12


def host_param_bytes(placement: Placement) -> int:
    """Non-expert parameters kept in pinned host memory: every step copies them in, so every chunk does."""
    return sum(nbytes for key, nbytes in placement.nbytes.items()
               if placement.memory_kind[key] == PINNED_HOST and placement.groups[key] != "experts")


def chunk_stream_bytes(placement: Placement, experts_per_layer: int) -> int:
    """Bytes one prefill chunk copies in (at most: a chunk needs nearly every expert): each offloaded layer's
    experts that no cache slot holds, plus the host-kept non-expert parameters. Under the disk tier the experts
    in no host row cross the link too, read from disk first."""
    missing = sum(experts_per_layer - cache for cache in placement.caches)
    return missing * placement.expert_bytes + host_param_bytes(placement)


def prefill_streams(placement: Placement, platform: str) -> bool:
    """Whether a prefill step copies weights in from host memory: on any platform but a CPU (whose prefill reads
    them in place), where some layer's experts or some non-expert parameter live on the host."""
    return platform != "cpu" and bool(placement.offloaded_layers or host_param_bytes(placement))


def prefill_flops_per_token(cfg: ModelConfig, params: dict, devices: int = 1) -> float:
    """2 x the weights one prompt token is multiplied by: every non-expert parameter but the embedding's lookup
    (the lm head's matrix when it is the embedding's), and top_k experts of every MoE layer; under expert
    parallelism over `devices`, one device's share of those. `params`: {path: anything with a shape}. Attention
    over the prompt's columns adds more with the context; leaving it out makes the chunk longer, not shorter."""
    dense = sum(math.prod(a.shape) for path, a in params.items() if "experts" not in path and path[0] != "embed")
    if cfg.tie_word_embeddings:
        dense += cfg.vocab_size * cfg.hidden_size
    expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size  # gate, up and down projections
    return 2.0 * (dense + cfg.num_moe_layers * cfg.num_experts_per_tok * expert / devices)


def chunk_length(stream_seconds: float, seconds_per_token: float, context: int) -> int:
    """The shortest chunk whose compute (`seconds_per_token` each) takes at least `stream_seconds`: a power of
    two, at least SMALL_CHUNK, at most `context`."""
    needed = max(1, math.ceil(stream_seconds / seconds_per_token))
    return min(max(SMALL_CHUNK, 1 << (needed - 1).bit_length()), context)


def prefill_chunk_for(placement: Placement, cfg: ModelConfig, params: dict, *, platform: str, context: int,
                      link_bytes_per_s: float | None = None, peak_flops: float | None = None,
                      devices: int = 1) -> int | None:
    """Prompt tokens per prefill chunk for this placement, or None where nothing streams (a CPU, or every weight
    on the device): keep the small chunks.

    params: the model's parameters or their shapes ({path: array or shape struct}; jmoe.model.params.abstract_params
        (cfg, dtype), which loading has already traced, or a plan's headers.abstract).
    platform: where the prefill runs ("cpu", "gpu", ...; jax.default_backend()).
    context: the most prompt tokens one sequence holds; the chunk is capped there.
    link_bytes_per_s, peak_flops: the host link's nominal bytes/s (measured, given, or a plan target's) and the
        device's nominal peak flops for the model's dtype; default DEFAULT_LINK_BYTES_PER_S / DEFAULT_PEAK_FLOPS.
        LINK_FRACTION and COMPUTE_FRACTION of them are what the rule assumes is reached.
    devices: GPUs the experts are split over (expert parallelism); `placement` is one device's, which streams its
        own share over its own link."""
    if not prefill_streams(placement, platform):
        return None
    link = (DEFAULT_LINK_BYTES_PER_S if link_bytes_per_s is None else link_bytes_per_s) * LINK_FRACTION
    compute = (DEFAULT_PEAK_FLOPS if peak_flops is None else peak_flops) * COMPUTE_FRACTION
    stream_seconds = chunk_stream_bytes(placement, cfg.num_experts // devices) / link
    return chunk_length(stream_seconds, prefill_flops_per_token(cfg, params, devices) / compute, context)
