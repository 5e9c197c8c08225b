"""What is specific to the DeepSeek-V3 (Kimi K2) and GLM-4.5 families: the latent KV cache, the grouped
router's selection, config checks, the kimi_k2 alias and block-scaled float8 checkpoints. Logits and greedy
tokens against transformers are in test_hf_parity.py, offload invariance in test_offload.py."""

import json
import math
import shutil
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmoe
from hf_models import VOCAB, edit_json
from jmoe.config import parse_config
from jmoe.errors import CheckpointError, ConfigError
from jmoe.model import empty_kv_cache, kv_bytes_per_token, router_probabilities

DEEPSEEK = "deepseek_v3_qlora_groups"
IDS = np.random.RandomState(4).randint(0, VOCAB, (2, 7))


def config_dict(hf_checkpoints, name):
    return json.loads((hf_checkpoints[name][0] / "config.json").read_text())


@pytest.mark.quick
def test_mla_cache_holds_the_latent_and_the_roped_key(hf_checkpoints):
    cfg = jmoe.load_config(hf_checkpoints[DEEPSEEK][0])
    latent, k_rope = empty_kv_cache(cfg, 2, 5, jnp.float32)[0]
    assert latent.shape == (2, 5, 1, cfg.mla.kv_lora_rank) and k_rope.shape == (2, 5, 1, cfg.mla.qk_rope_head_dim)
    assert kv_bytes_per_token(cfg, jnp.bfloat16) == cfg.num_layers * (16 + 4) * 2
    model = jmoe.load(hf_checkpoints[DEEPSEEK][0], cache=2, progress=False)
    assert model.placement_plan.kv_bytes_per_token == cfg.num_layers * (16 + 4) * 4
    assert f"KV cache: {cfg.num_layers * 20 * 4:,} bytes per token" in model.placement_plan.summary()


@pytest.mark.quick
def test_prefetch_score_top_k_is_the_routers_choice(hf_checkpoints):
    """router_probabilities' top-k (what prefetch copies) is exactly the experts route() picks."""
    model = jmoe.load(hf_checkpoints[DEEPSEEK][0], progress=False)
    block = model.module().moe_blocks()[0]
    cfg = model.config
    x = jnp.asarray(np.random.RandomState(0).randn(64, cfg.hidden_size).astype(np.float32))
    ids, weights = block.route(x, jnp.ones((64,), bool))
    scores = np.asarray(router_probabilities(cfg, block.router_params(), x))
    top = np.argsort(-scores, axis=-1)[:, :cfg.num_experts_per_tok]
    assert (np.sort(top, -1) == np.sort(np.asarray(ids), -1)).all()
    # Only the best topk_group groups are eligible; the weights sum to routed_scaling_factor (norm_topk_prob).
    assert (np.isinf(scores).sum(-1) == (cfg.n_group - cfg.topk_group) * cfg.num_experts // cfg.n_group).all()
    np.testing.assert_allclose(np.asarray(weights).sum(-1), cfg.routed_scaling_factor, rtol=1e-5)


@pytest.mark.quick
def test_kimi_k2_is_deepseek_v3(hf_checkpoints, tmp_path):
    directory = tmp_path / "kimi"
    shutil.copytree(hf_checkpoints[DEEPSEEK][0], directory)
    edit_json(directory / "config.json", model_type="kimi_k2")
    kimi = jmoe.load(directory, progress=False)
    assert kimi.config.family == "deepseek_v3"
    reference = jmoe.load(hf_checkpoints[DEEPSEEK][0], progress=False)
    np.testing.assert_array_equal(np.asarray(kimi.logits(IDS)), np.asarray(reference.logits(IDS)))


@pytest.mark.parametrize("name, changes, match", [
    (DEEPSEEK, {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     r"unsupported rope scaling type 'longrope' in rope_parameters\.rope_type; supported: default, linear, yarn"),
    (DEEPSEEK, {"rope_scaling": {"type": "dynamic"}, "rope_parameters": None},
     r"unsupported rope scaling type 'dynamic' in rope_scaling\.type"),
    (DEEPSEEK, {"quantization_config": {"quant_method": "gptq"}},
     r"unsupported quantization_config\.quant_method 'gptq'; supported: fp8"),
    (DEEPSEEK, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     r"quantization_config\.weight_block_size must be \[rows, columns\]"),
    (DEEPSEEK, {"n_group": 3}, r"n_group \(3\) must split the 8 routed experts"),
    (DEEPSEEK, {"topk_group": 1, "num_experts_per_tok": 3}, r"topk_group \(1\) .* hold num_experts_per_tok \(3\)"),
    (DEEPSEEK, {"kv_lora_rank": 0}, r"kv_lora_rank must be a whole number in \[1, "),
    (DEEPSEEK, {"q_lora_rank": 1.5}, r"q_lora_rank must be a whole number"),
    (DEEPSEEK, {"qk_rope_head_dim": 3}, r"qk_rope_head_dim must be even"),
    (DEEPSEEK, {"routed_scaling_factor": -1}, r"routed_scaling_factor must be a finite number > 0"),
    (DEEPSEEK, {"first_k_dense_replace": "one"}, r"first_k_dense_replace must be a whole number"),
    (DEEPSEEK, {"n_shared_experts": -1}, r"n_shared_experts must be a whole number in \[0, "),
    (DEEPSEEK, {"n_shared_experts": 1000, "moe_intermediate_size": 1 << 20}, r"n_shared_experts \(1000\) x "
     r"moe_intermediate_size \(1048576\) must be at most"),
    (DEEPSEEK, {"rope_interleave": "yes"}, r"rope_interleave must be true or false"),
    (DEEPSEEK, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0}},
     r"rope_parameters\.factor must be a finite number > 0"),
    (DEEPSEEK, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "beta_fast": "x"}},
     r"rope_parameters\.beta_fast must be a finite number > 0"),
    ("glm4_moe_partial_qknorm", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     r"partial_rotary_factor 1\.5 gives 24 rotated dimensions of head_dim 16"),
])
def test_bad_config_values_name_their_key(hf_checkpoints, name, changes, match):
    config = {**config_dict(hf_checkpoints, name), **changes}
    with pytest.raises(ConfigError, match=match):
        parse_config(config)


def test_missing_q_lora_rank_is_named(hf_checkpoints):
    config = config_dict(hf_checkpoints, DEEPSEEK)
    del config["q_lora_rank"]
    with pytest.raises(ConfigError, match="missing required key 'q_lora_rank' \\(null for a plain q projection\\)"):
        parse_config(config)


def test_glm4_moe_every_cache_size_matches_resident(hf_checkpoints):
    """The offload invariance test_offload.py runs per family (pure streaming and a half-full cache), with one
    policy (it is the same router as DeepSeek-V3's, which runs them all)."""
    directory = hf_checkpoints["glm4_moe_partial_qknorm"][0]
    base = jmoe.load(directory, progress=False)
    prompts = [list(np.random.RandomState(seed).randint(0, VOCAB, n)) for seed, n in ((1, 11), (2, 4))]
    ref_logits, ref_tokens = np.asarray(base.logits(IDS)), base.generate(prompts, max_new_tokens=8)
    e = base.config.num_experts
    for cache in (0, e // 2):
        model = jmoe.load(directory, cache=cache, policy="lru", progress=False)
        np.testing.assert_allclose(np.asarray(model.logits(IDS)), ref_logits, atol=1e-5, rtol=0, err_msg=f"{cache}")
        assert model.generate(prompts, max_new_tokens=8) == ref_tokens, f"cache={cache}"


# --- block-scaled float8 checkpoints ---------------------------------------------------------------------------

BLOCK = (8, 16)  # small blocks so that a tiny model has several, and partial ones at its edges
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def quantize_blocks(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(r/br), ceil(c/bc)]): each block scaled so its largest
    magnitude maps to float8's largest value."""
    rows, cols = w.shape
    scale_inv = np.zeros((math.ceil(rows / block[0]), math.ceil(cols / block[1])), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].astype(np.float32)
            scale_inv[i, j] = max(np.abs(part).max(), 1e-12) / FP8_MAX
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale_inv[i, j]).astype(
                ml_dtypes.float8_e4m3fn)
    return q, scale_inv


def dequantize_reference(q: np.ndarray, scale_inv: np.ndarray, block=BLOCK) -> np.ndarray:
    """The format's definition, written out: every element times the inverse scale of its block."""
    full = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[:q.shape[0], :q.shape[1]]
    return q.astype(np.float32) * full


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def quantized_linear(name: str, array: np.ndarray) -> bool:
    """The tensors DeepSeek-V3 ships in float8: 2-D projection weights, not embeddings, head or router."""
    return array.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def fp8_pair(hf_checkpoints, tmp_path_factory):
    """(fp8 checkpoint, float32 checkpoint of its weights dequantized by the reference) of DEEPSEEK."""
    from safetensors.numpy import load_file

    source = hf_checkpoints[DEEPSEEK][0]
    original = load_file(source / "model.safetensors")
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, ref_dir = root / "fp8", root / "ref"
    quantized, reference = {}, {}
    for name, array in original.items():
        if quantized_linear(name, array):
            q, scale_inv = quantize_blocks(array)
            quantized[name], quantized[name + "_scale_inv"] = q, scale_inv
            reference[name] = dequantize_reference(q, scale_inv)
        else:
            quantized[name] = reference[name] = array
    for directory, tensors in ((fp8_dir, quantized), (ref_dir, reference)):
        directory.mkdir()
        shutil.copy(source / "config.json", directory / "config.json")
        write_safetensors(directory / "model.safetensors", tensors)
    edit_json(fp8_dir / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                                            "activation_scheme": "dynamic", "fmt": "e4m3"})
    return fp8_dir, ref_dir


def test_fp8_checkpoint_loads_as_its_reference_dequantization(fp8_pair, hf_checkpoints):
    fp8_dir, ref_dir = fp8_pair
    with open(fp8_dir / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert any(k.endswith("_scale_inv") and min(v["shape"]) > 1 for k, v in header.items())  # several blocks
    fp8 = np.asarray(jmoe.load(fp8_dir, progress=False).logits(IDS))
    np.testing.assert_array_equal(fp8, np.asarray(jmoe.load(ref_dir, progress=False).logits(IDS)))
    # Quantization (3 mantissa bits) moved the logits, but they still follow the unquantized model's.
    unquantized = np.asarray(jmoe.load(hf_checkpoints[DEEPSEEK][0], progress=False).logits(IDS))
    assert np.abs(fp8 - unquantized).max() > 0 and np.corrcoef(fp8.ravel(), unquantized.ravel())[0, 1] > 0.95


def test_fp8_checkpoint_plans_converts_and_offloads(fp8_pair, tmp_path):
    from jmoe.checkpoint.convert import convert_checkpoint
    from jmoe.plan.headers import read_headers

    fp8_dir, ref_dir = fp8_pair
    headers = read_headers(fp8_dir)
    assert headers.stored_dtypes["F8_E4M3"] > 0
    ref = np.asarray(jmoe.load(ref_dir, progress=False).logits(IDS))
    converted = convert_checkpoint(fp8_dir, tmp_path / "orbax", progress=False)
    np.testing.assert_array_equal(np.asarray(jmoe.load(converted, cache=1, progress=False).logits(IDS)), ref)


@pytest.mark.quick
def test_fp8_checkpoint_problems_are_named(fp8_pair, tmp_path):
    fp8_dir, _ = fp8_pair
    broken = tmp_path / "broken"
    shutil.copytree(fp8_dir, broken)
    edit_json(broken / "config.json", quantization_config=None)
    with pytest.raises(CheckpointError, match="is float8 but config.json has no quantization_config"):
        jmoe.load(broken, progress=False)
    edit_json(broken / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    with pytest.raises(CheckpointError, match=r"_scale_inv' is F32 \[\d+, \d+\], expected F32 \[\d+, \d+\]"):
        jmoe.load(broken, progress=False)


@pytest.mark.quick
def test_fp8_checkpoint_matches_transformers(tmp_path):
    """transformers loads a float8 checkpoint on CPU by dequantizing it (it needs accelerate, and blocks that
    divide every quantized weight): jmoe computes the same logits."""
    pytest.importorskip("accelerate")
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from hf_models import FAMILY_CASES, write_checkpoint

    overrides = {**FAMILY_CASES[DEEPSEEK][1], "q_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 8,
                 "intermediate_size": 48}  # every quantized dimension a multiple of 8
    write_checkpoint(tmp_path / "source", "deepseek_v3", **overrides)
    tensors = {}
    for name, array in load_file(tmp_path / "source" / "model.safetensors").items():
        if quantized_linear(name, array):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(array, (8, 8))
        else:
            tensors[name] = array
    directory = tmp_path / "fp8"
    directory.mkdir()
    shutil.copy(tmp_path / "source" / "config.json", directory / "config.json")
    write_safetensors(directory / "model.safetensors", tensors)
    edit_json(directory / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [8, 8],
                                                              "activation_scheme": "dynamic"})
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = reference(torch.tensor(IDS)).logits.detach().numpy()
    np.testing.assert_allclose(np.asarray(jmoe.load(directory, progress=False).logits(IDS)), expected, atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("rope", [
    # DeepSeek-V3's own config.json (old-style rope_scaling): the frequencies and both scales at full size.
    {"rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, "rope_theta": 10000},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "mscale": 0.707,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "truncate": False}},
])
def test_yarn_at_deepseek_scale_matches_transformers(rope):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from jmoe.model.rope import inv_freq

    sizes = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None,
                 kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 max_position_embeddings=163840, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    hf = DeepseekV3Config(**sizes, **rope)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = parse_config({"model_type": "deepseek_v3", "moe_intermediate_size": 32, "intermediate_size": 64,
                        **sizes, **rope})
    np.testing.assert_allclose(inv_freq(cfg), expected.numpy(), rtol=1e-6)
    assert cfg.rope_yarn.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert cfg.mla.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, (128 + 64) ** -0.5), rel=1e-12)
