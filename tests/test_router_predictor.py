"""The router predictor's guesses (jmoe.traces.router_guess), checked against the module's plain forward and a
case with a known answer."""

import jax
import numpy as np
import pytest
from flax import nnx

import jmoe
from jmoe.errors import InputError
from jmoe.model import MoEBlock, MoETransformer, empty_kv_cache
from jmoe.model.params import flat_params
from jmoe.offload.placement import plan_placement
from jmoe.offload.resident import ResidentEngine
from jmoe.traces.evaluation import precision_recall
from jmoe.traces.router_guess import router_guesses

VOCAB = 64
# Decoder layer 1 is dense, so MoE layer positions (0, 1, 2) differ from decoder layer indices (0, 2, 3).
CONFIG = jmoe.parse_config(dict(
    model_type="qwen2_moe", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, intermediate_size=24, mlp_only_layers=[1], max_position_embeddings=64))
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 12))


def make_model(edit=lambda module: None) -> jmoe.Model:
    """A random resident model whose module `edit` may change before it is wrapped."""
    module = MoETransformer(CONFIG, rngs=nnx.Rngs(0))
    # Larger router weights than the init's 0.02, so the top experts are far from ties.
    for block in module.moe_blocks():
        block.router.kernel[...] = block.router.kernel[...] * 50
    edit(module)
    placement = plan_placement(CONFIG, flat_params(nnx.to_pure_dict(nnx.state(module))))
    return jmoe.Model(module, CONFIG, ResidentEngine(CONFIG, placement, "reference"))


@pytest.fixture(scope="module")
def model():
    return make_model()


def reference_forward(model, tokens) -> tuple[list[np.ndarray], np.ndarray]:
    """(each MoE layer's router input [B*T, d], routing [L, B, T, k]) from the module's plain forward."""
    route = MoEBlock.route

    def forward(tokens):
        seen = []

        def recording_route(self, x, *args):
            seen.append(x)
            return route(self, x, *args)

        b, t = tokens.shape
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(MoEBlock, "route", recording_route)
            out = model.module()(tokens, empty_kv_cache(CONFIG, b, t, np.float32), 0, np.zeros(b, np.int32))
        return seen, out.routing

    # Jitted only because compiling every op of an eager forward one by one takes longer.
    seen, routing = jax.jit(forward)(tokens)
    return [np.asarray(x) for x in seen], np.asarray(routing)


def test_guesses_match_next_router_on_this_layers_input(model):
    guesses = router_guesses(model, TOKENS)
    inputs, routing = reference_forward(model, TOKENS)
    blocks = model.module().moe_blocks()
    for layer in range(CONFIG.num_moe_layers - 1):
        logits = inputs[layer].astype(np.float64) @ np.asarray(blocks[layer + 1].router.kernel[...], np.float64).T
        expected = np.exp(logits - logits.max(-1, keepdims=True))
        expected /= expected.sum(-1, keepdims=True)
        np.testing.assert_allclose(guesses.probs[:, layer], expected, atol=1e-5, err_msg=f"MoE layer {layer + 1}")
    np.testing.assert_array_equal(guesses.ids, routing.transpose(1, 2, 0, 3).reshape(guesses.ids.shape))


@pytest.mark.quick
def test_copied_router_guesses_the_previous_layers_experts():
    # With every router equal to the first one, the guess for MoE layer l + 1 is softmax(router_l(h_l)),
    # whose top k is what layer l chose; its score is then the overlap of consecutive layers' choices.
    def copy_first_router(module):
        first = module.moe_blocks()[0].router.kernel[...]
        for block in module.moe_blocks()[1:]:
            block.router.kernel[...] = first

    guesses = router_guesses(make_model(copy_first_router), TOKENS)
    k, e = CONFIG.num_experts_per_tok, CONFIG.num_experts
    before = guesses.ids[:, :-1]
    expected_sets = np.zeros(before.shape[:2] + (e,), bool)
    np.put_along_axis(expected_sets, before, True, axis=-1)
    np.testing.assert_array_equal(guesses.predicted(k), expected_sets)

    overlap = np.array([[len(set(a) & set(b)) for a, b in zip(row[:-1], row[1:])] for row in guesses.ids.tolist()])
    assert 0 < overlap.sum() < overlap.size * k  # neither trivially right nor trivially wrong
    scores = guesses.precision_recall(k)
    np.testing.assert_allclose(scores["layer_precision"], overlap.mean(0) / k)
    np.testing.assert_allclose(scores["layer_recall"], overlap.mean(0) / k)
    assert scores["precision"] == pytest.approx(overlap.sum() / overlap.size / k)
    every = guesses.precision_recall(e)
    assert (every["recall"], every["precision"]) == (1.0, pytest.approx(k / e))


def test_padding_is_left_out(model):
    lengths = np.array([12, 5])
    mask = np.arange(12)[None] < lengths[:, None]
    padded = np.where(mask, TOKENS, VOCAB - 1)
    guesses = router_guesses(model, padded, mask)
    # Causal attention: a real token's guesses are those of the unpadded rows at the same position.
    unpadded = router_guesses(model, TOKENS)
    assert len(guesses.probs) == len(guesses.ids) == lengths.sum()
    np.testing.assert_allclose(guesses.probs, unpadded.probs.reshape(2, 12, 2, -1)[mask], atol=1e-6)
    np.testing.assert_array_equal(guesses.ids, unpadded.ids.reshape(2, 12, 3, -1)[mask])
    assert guesses.precision_recall(2) == precision_recall(guesses.predicted(2), guesses.guessed_ids)


@pytest.mark.parametrize("tokens, mask, message", [
    (TOKENS[0], None, "shaped \\[batch, tokens\\].*tokens\\[None\\]"),
    (TOKENS, np.ones((2, 11), bool), "bool mask shaped like the tokens \\[2, 12\\], found bool \\[2, 11\\]"),
    (TOKENS, np.arange(12)[None] >= np.array([[0], [3]]), "real token after padding in row 1; move"),
    (np.full((1, 3), VOCAB), None, f"token ids in \\[0, {VOCAB}\\), found {VOCAB} at \\[0, 0\\]"),
])
def test_bad_input_says_what_to_change(model, tokens, mask, message):
    with pytest.raises(InputError, match=message):
        router_guesses(model, tokens, mask)


def test_model_without_a_layer_before_is_rejected():
    cfg = CONFIG.replace(moe_layers=(True, False, False, False))
    model = jmoe.random_model(cfg, backend="reference")
    with pytest.raises(InputError, match="at least 2 MoE layers.*found 1"):
        router_guesses(model, TOKENS)

