"""jmoe.eval: perplexity against a NumPy reference, offload parity, padding, routing sums, compiles, CLI."""

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest

import jmoe
from hf_models import VOCAB, write_checkpoint, write_word_tokenizer
from jmoe import eval as jeval
from jmoe.cli import eval as eval_cli
from jmoe.eval import metrics as eval_metrics
from jmoe.errors import InputError

SEQ = 32
TOP_K = 2
# 7 windows of 32 (the last one partial: 200 = 6 * 32 + 8), so batch size 4 leaves a padded row.
NUM_TOKENS = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval") / "m"
    write_checkpoint(d, "mixtral", num_local_experts=4, num_experts_per_tok=TOP_K, intermediate_size=24,
                     num_attention_heads=2, num_key_value_heads=1)
    write_word_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def stream():
    return np.random.default_rng(0).integers(0, VOCAB, NUM_TOKENS)


@pytest.fixture(scope="module")
def text_file(model_dir, stream):
    path = model_dir.parent / "data.txt"
    lines = [" ".join(f"w{t}" for t in stream[i:i + 17]) for i in range(0, NUM_TOKENS, 17)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return jmoe.load(model_dir, progress=False)


def reference(model, stream, seq_len):
    """Mean NLL and per-layer expert load, one unpadded window at a time, log-softmax in NumPy."""
    full = len(stream) // seq_len * seq_len
    nll, count = 0.0, 0
    load = np.zeros((model.config.num_moe_layers, model.config.num_experts), np.int64)
    # The full windows as one batch, then the partial last window alone: no padding anywhere.
    for rows in (stream[:full].reshape(-1, seq_len), stream[None, full:]):
        logits, routing = model.logits_and_routing(rows)
        logits = np.asarray(logits, np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= np.take_along_axis(logp[:, :-1], rows[:, 1:, None], -1).sum()
        count += rows[:, 1:].size
        for layer in range(load.shape[0]):
            load[layer] += np.bincount(routing[layer].ravel(), minlength=load.shape[1])
    return nll / count, load


@pytest.mark.quick
def test_text_file_perplexity_and_routing_match_numpy_reference(model, stream, text_file):
    result = jeval.evaluate_file(model, text_file, batch_size=4, seq_len=SEQ)  # a padded row, a partial window
    nll, load = reference(model, stream, SEQ)
    assert result.tokens == NUM_TOKENS
    assert result.windows == 7
    assert result.predicted_tokens == NUM_TOKENS - 7  # each window's first token is not predicted
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
    assert [r.load for r in result.routing] == load.tolist()
    assert [r.layer for r in result.routing] == list(model.config.moe_layer_indices)


@pytest.mark.quick
def test_offloaded_model_gives_the_same_result(model_dir, text_file, model):
    resident = jeval.evaluate_file(model, text_file, batch_size=4, seq_len=SEQ)
    offloaded_model = jmoe.load(model_dir, cache=1, progress=False)
    assert offloaded_model.stats()  # really offloaded: the engine tracks per-layer traffic
    offloaded = jeval.evaluate_file(offloaded_model, text_file, batch_size=4, seq_len=SEQ)
    assert offloaded.perplexity == pytest.approx(resident.perplexity, rel=1e-5)
    assert [r.load for r in offloaded.routing] == [r.load for r in resident.routing]


def test_padded_rows_and_positions_do_not_count(model, stream):
    padded = jeval.evaluate(model, stream, batch_size=4, seq_len=SEQ)  # second batch: 3 windows + 1 pad row
    unpadded_rows = jeval.evaluate(model, stream, batch_size=7, seq_len=SEQ)  # one batch of all 7 windows
    assert padded.batch_shapes == [[4, SEQ]]
    assert unpadded_rows.batch_shapes == [[7, SEQ]]
    assert padded.perplexity == pytest.approx(unpadded_rows.perplexity, rel=1e-5)
    assert padded.predicted_tokens == unpadded_rows.predicted_tokens == NUM_TOKENS - 7
    assert [r.load for r in padded.routing] == [r.load for r in unpadded_rows.routing]


@pytest.mark.parametrize("windows, batch_size, rows", [(4, 4, 4), (1, 4, 1), (3, 4, 4), (5, 8, 8), (5, 6, 6)])
def test_last_batch_rows_round_up_to_a_power_of_two_at_most_batch_size(windows, batch_size, rows):
    lengths = np.full(windows, 5)
    lengths[-1] = 2
    tokens, mask = eval_metrics.padded_batch(np.ones((windows, 5), np.int32), lengths, batch_size)
    assert tokens.shape == mask.shape == (rows, 5)
    assert mask.sum(1).tolist() == lengths.tolist() + [0] * (rows - windows)
    assert (mask == (np.arange(5) < mask.sum(1)[:, None])).all()  # real tokens are a prefix of each row
    assert (tokens[windows:] == 0).all()


def test_routing_statistics_are_consistent(model, stream):
    result = jeval.evaluate(model, stream, batch_size=4, seq_len=SEQ)
    for r in result.routing:
        load = np.asarray(r.load)
        assert load.sum() == NUM_TOKENS * TOP_K
        share = load / load.sum()
        entropy = -sum(p * math.log(p) for p in share if p > 0)
        assert r.entropy_nats == pytest.approx(entropy)
        assert r.entropy_normalized == pytest.approx(entropy / math.log(len(load)))
        assert 0 < r.entropy_normalized <= 1
        assert r.busiest_expert == int(load.argmax())
        assert r.busiest_share == pytest.approx(load.max() / load.sum())


def test_five_batches_of_one_shape_compile_once(model_dir, stream):
    model = jmoe.load(model_dir, progress=False)  # fresh jit caches
    nll_compiles = eval_metrics._nll_sum._cache_size()
    result = jeval.evaluate(model, np.resize(stream, 5 * 3 * 24), batch_size=3, seq_len=24)
    assert result.batch_shapes == [[3, 24]]
    assert result.windows == 15
    assert model._logits_fn._cache_size() == 1
    assert eval_metrics._nll_sum._cache_size() == nll_compiles + 1
    assert result.steady_tokens_per_second > 0  # batches 2..5 are timed without compilation


def test_token_file_formats_match_the_text(model, stream, text_file, tmp_path):
    np.save(tmp_path / "data.npy", stream.astype(np.uint16))
    (tmp_path / "data.ids").write_text("\n".join(" ".join(map(str, stream[i:i + 9])) for i in range(0, 200, 9)))
    expected = jeval.evaluate_file(model, text_file, batch_size=4, seq_len=SEQ).perplexity
    for name in ("data.npy", "data.ids"):
        assert jeval.evaluate_file(model, tmp_path / name, batch_size=4, seq_len=SEQ).perplexity == \
            pytest.approx(expected, rel=1e-6)


@pytest.fixture
def loads(monkeypatch, model):
    """Make the CLI reuse the module's model (no recompilation); records the loader's arguments."""
    calls = []

    def fake_load(path, options, **kwargs):
        calls.append((path, {"cache": options.cache, "policy": options.policy, **kwargs}))
        return model

    monkeypatch.setattr(jmoe.api, "load_with_options", fake_load)
    return calls


def test_cli_json_prints_one_object(model_dir, text_file, model, loads, capsys):
    code = eval_cli.main(["--model", str(model_dir), "--data", str(text_file), "--seq-len", str(SEQ),
                       "--batch-size", "4", "--cache", "2", "--policy", "lru", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    assert loads == [(model_dir, {"cache": 2, "policy": "lru", "backend": "auto", "compile_cache": None})]
    assert out.strip().count("\n") == 0
    report = json.loads(out)
    assert report["cache"] == 2 and report["data_format"] == "text"
    expected = jeval.evaluate_file(model, text_file, batch_size=4, seq_len=SEQ)
    assert report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert report["routing"] == [dataclasses.asdict(r) for r in expected.routing]


def test_cli_table(model_dir, text_file, loads, capsys):
    args = ["--model", str(model_dir), "--data", str(text_file), "--seq-len", str(SEQ), "--batch-size", "4"]
    assert eval_cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("perplexity ")
    table_rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table_rows) == 1 + 2  # header + one row per MoE layer


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("make_data, flags, expected", [
    (lambda d: d / "missing.txt", [], "--data"),
    (lambda d: _write(d / "empty.ids", "\n"), [], "found none"),
    (lambda d: _write(d / "short.ids", "1 2 3"), ["--seq-len", "8"], "lower --seq-len"),
    (lambda d: _write(d / "ok.ids", "1 2 3 4"), ["--seq-len", "300"], "max_position_embeddings (256)"),
    (lambda d: _write(d / "ok.ids", "1 2 3 4"), ["--batch-size", "0", "--seq-len", "2"], "--batch-size"),
    (lambda d: _write(d / "vocab.ids", f"1 2 {VOCAB} 4"), ["--seq-len", "2"], f"token id {VOCAB} at position 2"),
    (lambda d: _write(d / "words.ids", "1 two 3"), [], "line 1"),
    (lambda d: _write(d / "data.csv", "1,2"), [], "unknown data format '.csv'"),
])
@pytest.mark.quick
def test_cli_bad_input(model_dir, tmp_path, capsys, make_data, flags, expected):
    code = eval_cli.main(["--model", str(model_dir), "--data", str(make_data(tmp_path))] + flags)
    err = capsys.readouterr().err
    assert code == 2
    last = err.strip().splitlines()[-1]  # after the loader's progress output
    assert last.startswith("error: ") and expected in last


def test_text_file_needs_a_tokenizer(model_dir, text_file, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="tokenizer.json"):
        jeval.evaluate_file(jmoe.load(bare, progress=False), text_file)


@pytest.mark.parametrize("array, expected", [
    (np.zeros((2, 40), np.int64), "1-D"),
    (np.zeros(40, np.float32), "integer"),
])
def test_npy_must_be_a_1d_integer_array(model, tmp_path, array, expected):
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(InputError, match=expected):
        jeval.evaluate_file(model, tmp_path / "x.npy", seq_len=SEQ)
