"""Every bad input gets a clear error that names the file, tensor or flag."""


import numpy as np
import pytest
import torch

import jmoe
from hf_models import VOCAB, edit_json
from jmoe.errors import CheckpointError, ConfigError, InputError

pytestmark = pytest.mark.quick  # the quick tier: all of this module


@pytest.fixture(scope="module")
def model(small_mixtral_dir):
    return jmoe.load(small_mixtral_dir, progress=False)


def _rewrite_weights(directory, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_missing_config_json(small_mixtral_copy):
    (small_mixtral_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        jmoe.load(small_mixtral_copy)


def test_unknown_model_type_lists_supported(small_mixtral_copy):
    edit_json(small_mixtral_copy / "config.json", model_type="llama4_moe")
    with pytest.raises(ConfigError, match="unknown model_type 'llama4_moe'.*mixtral.*olmoe.*qwen2_moe.*qwen3_moe"):
        jmoe.load(small_mixtral_copy)


def test_unsupported_rope_scaling_lists_supported(small_mixtral_copy):
    edit_json(small_mixtral_copy / "config.json", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                   "factor": 4.0})
    with pytest.raises(ConfigError, match=r"unsupported rope scaling type 'dynamic' in rope_parameters\.rope_type"
                                          r".*default, linear, yarn"):
        jmoe.load(small_mixtral_copy)


def test_missing_tensor_is_named(small_mixtral_copy):
    _rewrite_weights(small_mixtral_copy, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.3\.w2"):
        jmoe.load(small_mixtral_copy)


def test_unexpected_tensor_is_named(small_mixtral_copy):
    _rewrite_weights(small_mixtral_copy, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.extra\.weight"):
        jmoe.load(small_mixtral_copy)


def test_wrong_shape_names_tensor_and_shapes(small_mixtral_copy):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_weights(small_mixtral_copy, lambda t: t.update({name: torch.zeros(8, 32)}))
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \[8, 32\], expected \[32, 32\]"):
        jmoe.load(small_mixtral_copy)


def test_truncated_safetensors(small_mixtral_copy):
    path = small_mixtral_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a valid safetensors file.*truncated"):
        jmoe.load(small_mixtral_copy)


def test_corrupted_safetensors_header(small_mixtral_copy):
    path = small_mixtral_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"!!garbage!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        jmoe.load(small_mixtral_copy)


def test_pickle_checkpoint_refused(small_mixtral_copy):
    (small_mixtral_copy / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, small_mixtral_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*arbitrary code.*safetensors"):
        jmoe.load(small_mixtral_copy)


def test_empty_prompt(model):
    with pytest.raises(InputError, match="prompt 0 is empty"):
        model.generate([], max_new_tokens=2)
    with pytest.raises(InputError, match="prompt 1 is empty"):
        model.generate([[1, 2], []], max_new_tokens=2)


def test_prompt_longer_than_max_positions(model):
    too_long = [1] * (model.config.max_position_embeddings + 1)
    with pytest.raises(InputError, match="more than the model's max_position_embeddings"):
        model.generate(too_long, max_new_tokens=1)
    with pytest.raises(InputError, match="exceeds max_position_embeddings.*max-new-tokens"):
        model.generate([1] * 250, max_new_tokens=10)


def test_token_id_outside_vocabulary(model):
    with pytest.raises(InputError, match=rf"token id {VOCAB} outside the vocabulary \[0, {VOCAB}\)"):
        model.generate([1, VOCAB], max_new_tokens=1)
    with pytest.raises(InputError, match="token id -1 outside the vocabulary"):
        model.logits(np.array([[3, -1]]))


def test_generate_text_without_tokenizer(model):
    with pytest.raises(InputError, match="no tokenizer.json"):
        model.generate_text("w1 w2")


def test_cli_reports_missing_model_dir(tmp_path, capsys):
    from jmoe.generate import main

    assert main(["--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
