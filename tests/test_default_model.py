"""The shipped default model (checkpoints/default): size and shape limits, transformers parity, CLI."""

import json
from pathlib import Path

import numpy as np
import pytest

from jmoe.cli.common import DEFAULT_MODEL_DIR

MAX_BYTES = 40 * 1024 * 1024
SNIPPET = "import os\n\n\nclass Cache:\n    def get(self, key, default=None):\n        return self._data.get(key, default)\n"


@pytest.fixture(scope="module")
def hf_config():
    path = DEFAULT_MODEL_DIR / "config.json"
    assert path.is_file(), f"{path} is missing; build it with `python -m checkpoints.recipe.train` (checkpoints/README.md)"
    return json.loads(path.read_text())


def test_size_and_shape_limits(hf_config):
    total = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir() if f.is_file())
    assert total <= MAX_BYTES, f"checkpoints/default is {total} bytes, limit {MAX_BYTES}"
    assert hf_config["num_experts"] >= 16
    assert hf_config["num_experts_per_tok"] >= 2
    assert hf_config["max_position_embeddings"] >= 512
    generation = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == hf_config["eos_token_id"]


@pytest.mark.quick
def test_transformers_and_jmoe_agree_in_float32(hf_config):
    import torch
    from transformers import AutoModelForCausalLM

    import jmoe

    model = jmoe.load(DEFAULT_MODEL_DIR, dtype="float32", progress=False)
    ids = model.tokenizer.encode(SNIPPET)
    ours = np.asarray(model.logits([ids]))
    ref_model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits.numpy()
    assert ours.shape == ref.shape == (1, len(ids), hf_config["vocab_size"])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_cli_without_model_generates_text(capsys):
    from jmoe.generate import main

    assert main(["--prompt", "def ", "--max-new-tokens", "12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert Path(report["model"]) == DEFAULT_MODEL_DIR
    assert len(report["token_ids"]) >= 1 and report["text"].strip()
