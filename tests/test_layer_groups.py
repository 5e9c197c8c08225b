"""Layer-group weight prefetch: N of every G layers' weights stay on the host and are fetched K layers
ahead inside the step; results never change."""

import json

import jax
import numpy as np
import pytest

import jmoe
import jmoe.api
from hf_models import VOCAB
from jmoe.decode import chain
from jmoe.offload.layer_groups import LayerGroups, prefetch_buffer_bytes

PROMPTS = [list(np.random.RandomState(7).randint(0, VOCAB, 9)), list(np.random.RandomState(8).randint(0, VOCAB, 3))]
LOGIT_IDS = np.random.RandomState(9).randint(0, VOCAB, (2, 7))


@pytest.fixture(scope="module")
def sparse_step_dir(hf_checkpoints):
    return hf_checkpoints["qwen2_moe_sparse_step_norm"][0]  # 4 layers: dense, MoE, dense, MoE


@pytest.fixture(scope="module")
def reference(sparse_step_dir):
    model = jmoe.load(sparse_step_dir, progress=False)
    return np.asarray(model.logits(LOGIT_IDS)), model.generate(PROMPTS, max_new_tokens=8)


@pytest.mark.parametrize("groups,extra", [
    ((2, 1, 1), {}),  # layers 1 and 3, each fetched as the layer before it starts
    ((4, 3, 2), {}),  # layers 1-3, two layers ahead (layers 1 and 2 both fetched at the step's start)
    ((1, 1, 3), {"offload_params": ["attn", "router"]}),  # every layer's attention and router
    ((2, 2, 1), {"cache": 1, "prefetch": 1, "miss_mode": "host"}),  # with expert offload on top
])
def test_grouped_weights_give_identical_results(sparse_step_dir, reference, groups, extra):
    size, num_in_group, step = groups
    model = jmoe.load(sparse_step_dir, offload_group_size=size, offload_num_in_group=num_in_group,
                      offload_prefetch_step=step, progress=False, **extra)
    ref_logits, ref_tokens = reference
    np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0)
    assert model.generate(PROMPTS, max_new_tokens=8) == ref_tokens


@pytest.mark.parametrize("layers_per_program", [1, 2])
def test_a_chained_step_fetches_each_block_s_group_weights(sparse_step_dir, reference, layers_per_program,
                                                           monkeypatch):
    """Chained (jmoe.decode.chain) in blocks of one layer, and of two: the dense first layer, layers 1-2 (layer 1
    fetched as its block starts), layer 3; the offloaded layers' weights fetched inside the blocks."""
    monkeypatch.setattr(chain, "LAYERS_PER_PROGRAM", layers_per_program)
    monkeypatch.setattr(jmoe.api, "chains", lambda config, engine: True)
    model = jmoe.load(sparse_step_dir, offload_group_size=2, offload_num_in_group=1, offload_prefetch_step=1,
                      progress=False)
    assert model.step_chain is not None
    ref_logits, ref_tokens = reference
    np.testing.assert_allclose(np.asarray(model.logits(LOGIT_IDS)), ref_logits, atol=1e-5, rtol=0)
    assert model.generate(PROMPTS, max_new_tokens=8) == ref_tokens
    blocks = {key[0] for key in model.step_chain.pieces if key[0] in model.step_chain._layer_fns.values()}
    # per step form (prompt, decode, logits): two kinds of one-layer block (dense on the device, MoE fetched), or
    # three blocks of their own
    assert len(blocks) == 3 * {1: 2, 2: 3}[layers_per_program]


@pytest.mark.quick
def test_placement_keeps_the_last_n_of_every_group_on_the_host(sparse_step_dir):
    model = jmoe.load(sparse_step_dir, offload_group_size=2, offload_num_in_group=1, offload_prefetch_step=1,
                      progress=False)
    kinds = {key: entry["memory_kind"] for key, entry in model.placement().items()}
    for layer in range(4):
        expected = "pinned_host" if layer % 2 == 1 else "device"
        assert kinds[f"layers.{layer}.attn.q.kernel"] == expected
        assert kinds[f"layers.{layer}.input_norm.scale"] == expected
    assert kinds["layers.1.mlp.router.kernel"] == "pinned_host"
    assert kinds["layers.1.mlp.experts.w_down"] == "device"  # experts are offloaded by the cache, not groups
    assert kinds["embed"] == "device" and kinds["final_norm.scale"] == "device"
    module = model.module()
    assert module.layers[1].attn.q.kernel[...].sharding.memory_kind == "pinned_host"
    placement = model.placement_plan
    layer_bytes = {layer: sum(placement.nbytes[k] for k in keys) for layer, keys in placement.fetched_keys.items()}
    assert sorted(layer_bytes) == [1, 3]
    # With K = 1 a fetched layer is on the device alone (layers 1 and 3 are never within one step of each other).
    assert placement.fetch_buffer_bytes == max(layer_bytes.values())
    device_params = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params)
                        if leaf.sharding.memory_kind == "device")
    assert placement.totals()["device_bytes"] == device_params + placement.fetch_buffer_bytes
    assert "layer prefetch" in placement.summary() and "layers 1, 3" in placement.summary()


def test_prefetch_buffer_bytes_counts_the_layers_in_flight():
    groups = LayerGroups(4, 3, 2)  # layers 1, 2, 3, 5, 6, 7 of 8
    sizes = {1: 10, 2: 20, 3: 40, 5: 1, 6: 2, 7: 4}
    # Layer i runs with the fetched layers among i .. i + 2: the most is layers 1-3 (70 bytes).
    assert prefetch_buffer_bytes(groups, sizes, 8) == 70
    assert [groups.fetched_at(layer) for layer in (1, 2, 3, 5)] == [0, 0, 1, 3]


@pytest.mark.quick
def test_every_fetch_waits_for_the_layer_it_is_issued_at(sparse_step_dir):
    """Each grouped layer's copies are tied to an optimization barrier on the residual stream."""
    model = jmoe.load(sparse_step_dir, offload_group_size=2, offload_num_in_group=1, offload_prefetch_step=1,
                      progress=False)
    text = model._logits_fn.lower(model.step_params, model.engine.state, np.asarray(LOGIT_IDS, np.int32)).as_text()
    assert text.count("stablehlo.optimization_barrier") == len(model.placement_plan.fetched_keys) == 2


@pytest.mark.quick
def test_bad_group_settings(sparse_step_dir):
    cases = [
        (dict(offload_group_size=2, offload_num_in_group=3), "num in group must be between 1 and the group size 2"),
        (dict(offload_group_size=2, offload_prefetch_step=0), "prefetch step must be >= 1"),
        (dict(offload_group_size=-1), "group size must be >= 1"),
        (dict(offload_num_in_group=2), r"need an offload group size >= 1 \(found 0"),
        (dict(offload_group_size=2, offload_params=["embed"]), "'embed' matches no parameter of the grouped layers"),
    ]
    for kwargs, message in cases:
        with pytest.raises(jmoe.InputError, match=message):
            jmoe.load(sparse_step_dir, progress=False, **kwargs)


def test_cli_group_flags(hf_checkpoints, tmp_path, capsys):
    import shutil

    from hf_models import write_word_tokenizer
    from jmoe.generate import main

    model_dir = tmp_path / "m"
    shutil.copytree(hf_checkpoints["qwen2_moe_sparse_step_norm"][0], model_dir)
    write_word_tokenizer(model_dir)
    args = ["--model", str(model_dir), "--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--json"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--offload-group-size", "2", "--offload-num-in-group", "1", "--offload-prefetch-step", "1",
                        "--miss-mode", "host", "--cache", "1"]) == 0

    assert json.loads(capsys.readouterr().out)["token_ids"] == json.loads(plain)["token_ids"]
