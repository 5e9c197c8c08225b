"""jmoe.plan.depth: which deep models are planned from two shallow compiles (the repeating layers found, the shallow
placements checked layer for layer) and the arithmetic that extrapolates their programs. Compiling deep models both
ways takes minutes: `python -m bench.plan_depth` does it (bench/results/plan_depth.md)."""

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jmoe.config import parse_config
from jmoe.model.params import abstract_params, flat_params
from jmoe.model.transformer import MoETransformer
from jmoe.offload.options import OffloadOptions
from jmoe.offload.placement import plan_placement
from jmoe.plan import depth
from jmoe.plan.hlo import ControlFlow
from jmoe.plan.programs import Program, extrapolated

DEFAULT = json.loads((Path(__file__).resolve().parents[1] / "checkpoints/default/config.json").read_text())


@pytest.mark.parametrize("signatures, layers, periods", [
    (["moe"] * 94, (2, 3), (2, 3, 94)),  # Qwen3-235B: every layer alike
    (["dense"] * 3 + ["moe"] * 58, (5, 6), (2, 3, 58)),  # DeepSeek-V3: a dense prefix
    (["sliding", "full"] * 18, (4, 6), (2, 3, 18)),  # GPT-OSS: alternating attention
    (["sliding", "full"] * 18 + ["sliding"], (5, 7), (2, 3, 18)),  # ... ending in a partial period
])
def test_the_repeating_layers_are_found(signatures, layers, periods):
    reduction = depth.find_reduction(signatures)
    assert (reduction.layers, reduction.periods) == (layers, periods)


@pytest.mark.parametrize("signatures", [["moe"] * 15,  # shallow enough to compile whole
                                        ["moe"] * 20 + ["last"],  # a layer that breaks the repetition at the end
                                        ["a", "b", "c", "d", "e", "f", "g", "h", "i"] * 2])  # a period past 8
def test_models_without_enough_repetition_are_compiled_whole(signatures):
    assert depth.find_reduction(signatures) is None


def test_extrapolation_is_linear_in_the_periods():
    reduction = depth.Reduction((2, 3), (2, 3, 10))
    assert reduction.extrapolate(100.0, 130.0) == pytest.approx(340.0)  # 100 + 30 x (10 - 2)
    flow = depth.extrapolated_flow(reduction, ControlFlow(0, 4, 2, 0, 8), ControlFlow(0, 6, 3, 0, 12))
    assert flow == ControlFlow(0, 20, 10, 0, 40)
    memory = {"argument_size_in_bytes": 1000, "output_size_in_bytes": 10, "alias_size_in_bytes": 10,
              "temp_size_in_bytes": 50}
    small = Program("decode", (1, 1), memory, {"flops": 10.0}, 1.0, 2.0, "", compiled_layers=None)
    large = Program("decode", (1, 1), {**memory, "argument_size_in_bytes": 1500, "temp_size_in_bytes": 60},
                    {"flops": 15.0}, 1.5, 3.0, "")
    deep = extrapolated(reduction, small, large)
    # sizes extrapolated, temporaries left out (they do not scale with depth)
    assert deep.memory_analysis == {"argument_size_in_bytes": 5000, "output_size_in_bytes": 10,
                                    "alias_size_in_bytes": 10}
    assert deep.device_bytes == 5000
    assert deep.cost_analysis == {"flops": pytest.approx(50.0)}
    assert (deep.lower_seconds, deep.compile_seconds, deep.compiled_layers) == (2.5, 5.0, (2, 3))
    failed = extrapolated(reduction, small, Program("decode", (1, 1), error="the compiler died"))
    assert failed.error == "the compiler died" and failed.memory_analysis is None


def default_shaped(layers: int):
    return parse_config({**DEFAULT, "num_hidden_layers": layers})


def placement_of(options):
    return lambda cfg: plan_placement(cfg, abstract_params(cfg, np.float32), options)


@pytest.mark.quick
def test_a_reduction_is_used_only_when_the_shallow_placements_match():
    cfg = default_shaped(20)
    reduction = depth.plan_reduction(cfg, placement_of(OffloadOptions(4)))
    assert reduction.layers == (2, 3) and reduction.periods == (2, 3, 20)
    # the first two MoE layers computed on the host: a prefix of two
    options = OffloadOptions(4, cpu_moe_layers=2)
    assert depth.plan_reduction(cfg, placement_of(options)).layers == (4, 5)
    for options in (OffloadOptions(tuple([4] * 19 + [2])),  # a cache per layer, sized for 20 layers
                    OffloadOptions(device_budget_gb=0.12)):  # a budget spread over all layers' experts
        assert depth.plan_reduction(cfg, placement_of(options)) is None


@pytest.mark.quick
def test_the_abstract_model_has_the_initialised_models_parameters():
    """abstract_params traces the initialisation with one key for every draw (jmoe.model.params._SameKey): the same
    paths, shapes and dtypes as a model really initialised, with a dense first layer among MoE layers."""
    cfg = parse_config({**DEFAULT, "num_hidden_layers": 3, "mlp_only_layers": [0]})
    real = flat_params(nnx.to_pure_dict(nnx.state(MoETransformer(cfg, rngs=nnx.Rngs(0)))))
    abstract = abstract_params(cfg, None)
    assert {path: (leaf.shape, leaf.dtype) for path, leaf in abstract.items()} == {
        path: (leaf.shape, leaf.dtype) for path, leaf in real.items()}
    assert ("layers", 0, "mlp", "w_gate_up") in abstract and ("layers", 1, "mlp", "experts", "w_gate_up") in abstract
