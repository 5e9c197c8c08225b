"""Loading variants, sampling, stopping, streaming and the command line."""

import json
import re

import numpy as np
import pytest

import jmoe
from hf_models import write_checkpoint, write_word_tokenizer
from jmoe.cli.common import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen") / "m"
    write_checkpoint(d, "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    write_word_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def model(model_dir):
    return jmoe.load(model_dir, progress=False)


def test_sharded_checkpoint_loads_identically(model_dir, model, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = [[5, 9, 2, 7]]
    np.testing.assert_array_equal(np.asarray(jmoe.load(sharded, progress=False).logits(ids)),
                                  np.asarray(model.logits(ids)))


def test_bfloat16_load(model_dir, model):
    bf16 = jmoe.load(model_dir, dtype="bfloat16", progress=False)
    assert bf16.module().layers[0].mlp.experts.w_gate_up[...].dtype.name == "bfloat16"
    ids = [[5, 9, 2, 7]]
    np.testing.assert_allclose(np.asarray(bf16.logits(ids)), np.asarray(model.logits(ids)), atol=0.1)


def test_sampling_is_seeded_and_filters_apply(model):
    prompt = [3, 1, 4, 1, 5]
    a = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=1)
    assert a == model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=1)
    draws = {tuple(model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=s)[0]) for s in range(4)}
    assert len(draws) > 1, "different seeds should give different samples at temperature 1"
    greedy = model.generate(prompt, max_new_tokens=8)
    assert model.generate(prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=5) == greedy
    assert model.generate(prompt, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5) == greedy


def test_top_k_only_draws_from_the_k_most_likely():
    import jax

    from jmoe.decode.sampling import SamplingParams, sample

    logits = jax.numpy.asarray(np.random.RandomState(0).randn(1, 50).astype(np.float32))
    top2 = set(np.argsort(-np.asarray(logits[0]))[:2].tolist())
    draws = {int(sample(logits, jax.random.PRNGKey(s), SamplingParams(2.0, top_k=2).arrays(1))[0]) for s in range(60)}
    assert draws == top2


def test_sampling_parameter_errors():
    from jmoe.decode.sampling import SamplingParams

    with pytest.raises(jmoe.InputError, match="temperature"):
        SamplingParams(-1.0)
    with pytest.raises(jmoe.InputError, match="top_p"):
        SamplingParams(1.0, top_p=0.0)


@pytest.mark.quick
def test_stops_at_eos_from_generation_config(model_dir, model, tmp_path):
    import shutil

    prompt = [3, 1, 4, 1, 5]
    free = model.generate(prompt, max_new_tokens=12)[0]
    stop = free[4]
    d = tmp_path / "eos"
    shutil.copytree(model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    stopped = jmoe.load(d, progress=False).generate(prompt, max_new_tokens=12)[0]
    assert stopped == free[: free.index(stop) + 1]


def test_generate_text_and_stream(model, capsys):
    text = model.generate_text("w3 w1 w4", max_new_tokens=6)
    assert len(text.split()) == 6 and all(w.startswith("w") for w in text.split())
    streamed = model.generate_text("w3 w1 w4", max_new_tokens=6, stream=True)
    assert streamed == text
    assert capsys.readouterr().out.strip() == text


@pytest.mark.quick
def test_cli_json(model_dir, capsys):
    from jmoe.generate import main

    assert main(["--model", str(model_dir), "--prompt", "w3 w1 w4", "--max-new-tokens", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_token_ids"] == [3, 1, 4]
    assert len(report["token_ids"]) == 5
    assert report["text"] == " ".join(f"w{t}" for t in report["token_ids"])
    assert report["timing"]["decode_steps"] == 4


def test_one_program_per_mode_for_all_sampling_parameters_and_bucketed_batches(model):
    """Sampling parameters are traced inputs and batches are bucketed: new values or a batch of the same
    bucket reuse the compiled programs (one for the prompt and one for decode, per greedy/sampling mode)."""
    rows = [[3, 1, 4], [1, 5, 9, 2]]
    model.generate(rows, max_new_tokens=4, temperature=0.7, top_k=5, seed=1)
    model.generate(rows, max_new_tokens=4)
    compiled = model.compiled_programs
    for temperature, top_k, top_p in [(1.3, 0, 1.0), (0.2, 2, 0.5), (5.0, 40, 0.99)]:
        model.generate(rows, max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p, seed=2)
    model.generate(rows[:1] * 2, max_new_tokens=4, temperature=0.9)  # same bucket of 2 rows
    assert model.compiled_programs == compiled
    three = [[3, 1, 4], [1, 5, 9, 2], [2, 7]]  # bucket 4: padding rows route nowhere and change nothing
    assert model.generate(three, max_new_tokens=6) == [model.generate(r, max_new_tokens=6)[0] for r in three]


def test_steps_take_the_parameters_flattened_once_and_see_replaced_ones(model_dir):
    """A compiled step flattens its arguments at every call; the Model hands its steps the parameters as one flat
    list (StepParams), made once while `params` stays the same object and again when it is replaced: the steps
    then compute with the new parameters, through the programs already compiled."""
    import jax

    model = jmoe.load(model_dir, progress=False)
    flat = model.step_params
    assert model.step_params is flat and flat.state is model.params
    assert len(flat.leaves) == len(jax.tree.leaves(model.params))
    logits = np.asarray(model.logits([[3, 1, 4]]))
    tokens = model.generate([3, 1, 4], max_new_tokens=4)
    programs = model.compiled_programs
    model.params = jax.tree.map(lambda a: a.copy(), model.params)  # the same values, a new object
    assert model.step_params is not flat
    np.testing.assert_array_equal(np.asarray(model.logits([[3, 1, 4]])), logits)
    model.params["final_norm"]["scale"].set_value(np.zeros_like(model.params["final_norm"]["scale"].get_value()))
    model.params = jax.tree.map(lambda a: a, model.params)  # a new object holding the zeroed norm
    assert not np.asarray(model.logits([[3, 1, 4]])).any()  # every logit of a zero norm's output is 0
    assert tokens != [[0] * 4] and model.generate([3, 1, 4], max_new_tokens=4) == [[0] * 4]  # argmax of zeros
    assert model.compiled_programs == programs


@pytest.mark.quick
def test_generation_reports_compilation_apart_from_decoding_and_says_what_it_compiles(model, capsys):
    from jmoe.decode.sampling import SamplingParams

    fresh = jmoe.Model(model.module(), model.config, type(model.engine)(model.config, model.placement_plan),
                       progress=True)
    first = fresh.generate_detailed([[3, 1, 4]], 6, SamplingParams())
    again = fresh.generate_detailed([[3, 1, 4]], 6, SamplingParams())
    assert first.compile_seconds > 0 and again.compile_seconds == 0
    assert first.decode_steps == again.decode_steps == 5
    layers = model.config.num_layers
    assert re.fullmatch(rf"compiling the prompt step \(1 x 16 tokens, (\d+) cache columns, {layers} layers\) \.\.\.\n"
                        rf"compiled the prompt step \(1 x 16 tokens, \1 cache columns, {layers} layers\) in [\d.]+ s\n"
                        rf"compiling the decode step \(1 x 1 tokens, \1 cache columns, {layers} layers\) \.\.\.\n"
                        rf"compiled the decode step \(1 x 1 tokens, \1 cache columns, {layers} layers\) in [\d.]+ s\n",
                        capsys.readouterr().err)


def test_persistent_compile_cache_serves_a_second_process(tmp_path):
    """A second process with the same model and shapes loads its programs from the cache directory."""
    import os
    import subprocess
    import sys

    script = (
        "import jax, jmoe\n"
        "from jax import monitoring\n"
        "hits = []\n"
        "monitoring.register_event_listener(lambda name, **kw: hits.append(name) "
        "if name == '/jax/compilation_cache/cache_hits' else None)\n"
        f"model = jmoe.load({str(DEFAULT_MODEL_DIR)!r}, cache=4, progress=False, compile_cache={str(tmp_path)!r})\n"
        "result = model.generate_detailed([[1, 2, 3]], 4, jmoe.decode.sampling.SamplingParams())\n"
        "print(len(hits), result.compile_seconds)\n"
    )

    def run():  # both processes compile with the suite's XLA_FLAGS (part of the cache key)
        env = {**os.environ, "JMOE_COMPILE_CACHE": "off"}
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr
        hits, seconds = out.stdout.split()
        return int(hits), float(seconds)

    first_hits, _ = run()
    assert first_hits == 0 and any(tmp_path.iterdir())
    second_hits, _ = run()
    assert second_hits >= 2  # at least the prompt and decode steps came from the cache


def test_a_prompt_step_reads_only_its_own_cache_columns_and_must_start_at_column_0(model):
    """The prompt step's attention reads only the prompt's columns of a longer cache (visible_len): its
    logits equal a full forward over the prompt alone; a prompt step written anywhere else is refused."""
    import jax
    import jax.numpy as jnp

    from jmoe.decode.sampling import SamplingParams
    from jmoe.errors import InputError
    from jmoe.model import empty_kv_cache

    rows = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    module = model.module()
    cache = empty_kv_cache(model.config, 1, 32, model.kv_dtype)
    pad = jnp.zeros((1,), jnp.int32)
    visible = module(rows, cache, 0, pad, visible_len=8).logits
    np.testing.assert_allclose(np.asarray(visible), np.asarray(model.logits(rows)), rtol=0, atol=1e-5)
    with pytest.raises(InputError, match="must start at cache column 0, got write_index=4"):
        model.run_step(rows, cache, 4, pad, jax.random.PRNGKey(0), 0, SamplingParams())


@pytest.mark.quick
def test_top_k_and_top_p_keep_what_sorting_keeps():
    """The sort-free filters keep exactly the tokens a sort keeps: top-k the k most likely and their ties, top-p
    (after top-k) the most likely tokens until their probabilities reach top_p, the one reaching it included."""
    import jax

    from jmoe.decode.sampling import SamplingArrays, filter_logits

    rng = np.random.RandomState(3)
    logits = rng.randn(6, 300).astype(np.float32) * rng.choice([0.3, 2.0, 8.0], size=(6, 1)).astype(np.float32)
    logits[0, :40] = logits[0, 0]  # ties across the top-k and top-p boundaries
    logits[1, ::3] = -1e30  # very unlikely tokens, some at the lowest float
    logits[2] = np.round(logits[2])  # many ties
    for top_k, top_p, temperature in [(0, 0.5, 1.0), (5, 1.0, 1.0), (7, 0.9, 0.7), (0, 0.999, 2.0), (1, 0.3, 1.0),
                                      (299, 0.05, 1.5), (10_000, 0.8, 1.0), (0, 1e-6, 1.0)]:
        params = SamplingArrays(np.full(6, temperature, np.float32), np.full(6, top_k, np.int32),
                                np.full(6, top_p, np.float32))
        kept = np.asarray(filter_logits(jax.numpy.asarray(logits), params)) > np.finfo(np.float32).min
        for row, row_kept in zip(logits / np.float32(temperature), kept):
            expected = np.ones(row.size, bool)
            if top_k:
                expected &= row >= np.sort(row)[::-1][min(top_k, row.size) - 1]
            if top_p < 1.0:
                masked = np.where(expected, row, -np.inf).astype(np.float64)
                probs = np.exp(masked - masked.max())
                probs /= probs.sum()
                order = np.argsort(-masked, kind="stable")
                before = np.cumsum(probs[order]) - probs[order]  # the mass of the tokens ahead of each
                cut = masked[order][before < top_p].min()  # the least likely token still kept
                expected &= masked >= cut
            np.testing.assert_array_equal(row_kept, expected, err_msg=f"top_k={top_k} top_p={top_p}")
