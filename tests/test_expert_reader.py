"""jmoe.checkpoint.expert_reader: an expert read by byte range is bitwise the slice of what loading stores (every
family; float, int8, int4, fp8 and MXFP4 storage; block-scaled float8 and MXFP4 checkpoints), only that
expert's bytes are read, every file fault is a CheckpointError (never other numbers), and closing leaves no
thread or file descriptor behind."""

import concurrent.futures
import errno
import gc
import json
import os
import re
import shutil
import struct
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jmoe
from hf_models import FAMILY_CASES, edit_json, write_checkpoint
from jmoe.checkpoint.expert_reader import THREAD_PREFIX, ExpertReader
from jmoe.checkpoint.loading import load_model
from jmoe.checkpoint.read_buffers import PIECE_THREAD_PREFIX
from jmoe.config import load_config, with_expert_dtype
from jmoe.errors import CheckpointError, InputError
from jmoe.kernels import FORMATS, quantize
from jmoe.plan.headers import read_headers
from test_families import quantize_blocks, quantized_linear, write_safetensors
from test_gpt_oss import encode_mxfp4


# ---- helpers ----

def loaded_experts(directory: Path, cfg, dtype=None) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {name: stacked host array}} of every routed experts parameter, exactly as load_model stores it
    (its placer sees each parameter's host array)."""
    stored: dict[int, dict[str, np.ndarray]] = {}

    def keep(path, host):
        if path[0] == "layers" and path[-2] == "experts":
            stored.setdefault(path[1], {})[path[-1]] = np.array(host)
        return jnp.asarray(host)

    load_model(directory, cfg, dtype=dtype, place=keep, progress=False)
    return stored


def assert_bitwise_equal(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (what, got.dtype, got.shape, expected.shape)
    assert got.tobytes() == expected.tobytes(), f"{what}: differs from loading's"  # bitwise, NaN-safe
    assert np.array_equal(got.astype(np.float64), expected.astype(np.float64)), what


def assert_reader_matches_loading(directory: Path, cfg, dtype=None) -> dict[int, dict[str, np.ndarray]]:
    """Every expert of every MoE layer, read concurrently, equals its slice of load_model's parameters."""
    expected = loaded_experts(directory, cfg, dtype)
    assert expected, "the model has no routed experts"
    with ExpertReader(directory, cfg, dtype=dtype) as reader:
        assert reader.layers == tuple(i for i, moe in enumerate(cfg.moe_layers) if moe) == tuple(sorted(expected))
        futures = {(layer, e): reader.submit(layer, e) for layer in reader.layers for e in range(cfg.num_experts)}
        for (layer, e), future in futures.items():
            got = future.result()
            assert sorted(got) == sorted(expected[layer]), (layer, e)
            for name, value in got.items():
                assert_bitwise_equal(value, expected[layer][name][e], f"layer {layer} expert {e} {name}")
    return expected


def quoted(path_or_name) -> str:
    return re.escape(str(path_or_name))


def header_entries(directory: Path) -> dict[str, tuple[Path, int, int, list]]:
    """Tensor name -> (file, absolute data begin, end, shape), parsed here from the safetensors headers."""
    entries = {}
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, meta in header.items():
            begin, end = meta["data_offsets"]
            entries[name] = (path, 8 + length + begin, 8 + length + end, meta["shape"])
    return entries


def expert_ranges(directory: Path, layer: int, expert: int, num_experts: int) -> set[tuple[Path, int, int]]:
    """The byte ranges that hold one expert, from the headers: whole per-expert tensors (with any block scales),
    or the expert's E-th of each stacked experts tensor (GPT-OSS: `mlp.experts.<name>`, expert axis first)."""
    ranges = set()
    for name, (path, begin, end, shape) in header_entries(directory).items():
        if f"layers.{layer}." not in name or ".experts." not in name:
            continue
        if f".experts.{expert}." in name:
            ranges.add((path, begin, end))
        elif name.split(".experts.")[1].count(".") == 0:  # a stacked tensor
            assert shape[0] == num_experts
            share = (end - begin) // num_experts
            ranges.add((path, begin + expert * share, begin + (expert + 1) * share))
    return ranges


def merged(ranges) -> list[tuple[str, int, int]]:
    out: list[list] = []
    for path, begin, end in sorted((str(p), b, e) for p, b, e in ranges):
        if out and out[-1][0] == path and out[-1][2] == begin:
            out[-1][2] = end
        else:
            out.append([path, begin, end])
    return [tuple(r) for r in out]


REAL_PREADV = os.preadv


class PreadLog:
    """os.preadv replaced: records (file, offset, bytes read) of every read, optionally failing some calls or
    reading at most `limit` bytes."""

    def __init__(self, monkeypatch, fail=lambda call: False, limit=None):
        self.reads, self.calls, self.fail, self.limit = [], 0, fail, limit
        self.lock = threading.Lock()
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd, buffers, offset):
        with self.lock:
            self.calls += 1
            call = self.calls
        if self.fail(call):
            raise OSError(errno.EIO, "Input/output error")
        (buffer,) = buffers
        count = REAL_PREADV(fd, [memoryview(buffer)[:self.limit]], offset)
        with self.lock:
            self.reads.append((Path(os.readlink(f"/proc/self/fd/{fd}")), offset, count))
        return count


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith((THREAD_PREFIX, PIECE_THREAD_PREFIX))]


def open_files() -> list[str]:
    """What this process's file descriptors point to, sorted (listing /proc/self/fd opens one more, gone again
    when a link is read: skipped)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            pass
    return sorted(targets)


SMALL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, num_attention_heads=2,
             num_key_value_heads=1)


@pytest.fixture(scope="module")
def sharded_mixtral(tmp_path_factory):
    """A small Mixtral in 7 shard files; an expert's w1 and w2 lie in one file, its w3 in another."""
    directory = tmp_path_factory.mktemp("sharded") / "m"
    write_checkpoint(directory, "mixtral", seed=3, max_shard_size="20KB", **SMALL)
    assert len(list(directory.glob("*.safetensors"))) > 2
    return directory


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    """A GPT-OSS checkpoint whose stacked expert weights are MXFP4 blocks and scales (test_gpt_oss's encoder)."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path_factory.mktemp("mxfp4") / "gpt_oss"
    write_checkpoint(directory, "gpt_oss", seed=5, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4)
    stored = {}
    for name, value in load_file(directory / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"] = encode_mxfp4(value)
        else:
            stored[name] = value
    save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    edit_json(directory / "config.json", quantization_config={"quant_method": "mxfp4"})
    return directory


@pytest.fixture(scope="module")
def fp8_deepseek(hf_checkpoints, tmp_path_factory):
    """DeepSeek-V3 with its projections (experts included) in block-scaled float8 with `weight_scale_inv`."""
    from safetensors.numpy import load_file

    source = hf_checkpoints["deepseek_v3_qlora_groups"][0]
    directory = tmp_path_factory.mktemp("fp8") / "deepseek"
    directory.mkdir()
    tensors = {}
    for name, array in load_file(source / "model.safetensors").items():
        if quantized_linear(name, array):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(array)
        else:
            tensors[name] = array
    write_safetensors(directory / "model.safetensors", tensors)
    shutil.copy(source / "config.json", directory / "config.json")
    edit_json(directory / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [8, 16],
                                                              "activation_scheme": "dynamic", "fmt": "e4m3"})
    return directory


# ---- exactness ----

@pytest.mark.parametrize("name", sorted(FAMILY_CASES))
@pytest.mark.quick
def test_every_expert_of_every_family_is_what_loading_stores(name, hf_checkpoints):
    directory = hf_checkpoints[name][0]
    assert_reader_matches_loading(directory, load_config(directory))


# Every storage format over a per-expert family (Mixtral), one with dense layers and sigmoid routing (DeepSeek) and
# a stacked one with biases (GPT-OSS); MXFP4's group of 32 rows divides only GPT-OSS's expert width here.
STORED = [(fmt, name) for fmt in (*FORMATS, "bfloat16")
          for name in ("mixtral_e4k2_gqa2", "deepseek_v3_qlora_groups", "gpt_oss_e4k2_window")
          if fmt != "mxfp4" or name.startswith("gpt_oss")]


@pytest.mark.parametrize("fmt,name", STORED)
def test_quantized_and_cast_experts_are_what_loading_stores(fmt, name, hf_checkpoints):
    directory = hf_checkpoints[name][0]
    cfg = with_expert_dtype(load_config(directory), fmt, 8 if fmt == "int4" else None)
    expected = assert_reader_matches_loading(directory, cfg)
    if fmt in FORMATS:
        assert {"w_gate_up_scale", "w_down_scale"} <= set(expected[min(expected)])
    else:
        assert expected[min(expected)]["w_down"].dtype == jnp.bfloat16


def test_a_bfloat16_model_reads_bfloat16_experts(hf_checkpoints):
    directory = hf_checkpoints["qwen3_moe_headdim_tied"][0]
    expected = assert_reader_matches_loading(directory, load_config(directory), dtype="bfloat16")
    assert expected[0]["w_gate_up"].dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_expert_quantized_alone_is_its_slice_of_the_quantized_stack(fmt):
    """Why the reader may quantize one expert: no format's scales span experts."""
    rng = np.random.default_rng(0)
    stack = rng.normal(size=(5, 256, 160)).astype(np.float32) * 0.05
    stack[2] *= 30  # experts of very different ranges
    stack[3, :, :7] = 0
    whole = quantize(stack, fmt)
    for e in range(stack.shape[0]):
        alone = quantize(stack[e], fmt)
        assert_bitwise_equal(alone.values, whole.values[e], f"{fmt} values of expert {e}")
        assert_bitwise_equal(alone.scales, whole.scales[e], f"{fmt} scales of expert {e}")


def test_block_scaled_float8_experts_read_with_their_scales(fp8_deepseek):
    cfg = load_config(fp8_deepseek)
    assert cfg.fp8_block == (8, 16)
    assert_reader_matches_loading(fp8_deepseek, cfg)
    with ExpertReader(fp8_deepseek, cfg) as reader:
        names = [n for n in header_entries(fp8_deepseek) if ".layers.1.mlp.experts.2." in n]
        assert sum(n.endswith("_scale_inv") for n in names) == 3
        assert reader.checkpoint_bytes(1, 2) == sum(e - b for _, b, e in expert_ranges(fp8_deepseek, 1, 2, 8))


def test_mxfp4_experts_read_as_jmoe_load_stores_them(mxfp4_gpt_oss):
    headers = read_headers(mxfp4_gpt_oss)  # jmoe.load's config: the checkpoint's experts stay MXFP4
    assert headers.config.expert_dtype == "mxfp4"
    assert_reader_matches_loading(mxfp4_gpt_oss, headers.config)
    assert_reader_matches_loading(mxfp4_gpt_oss, with_expert_dtype(headers.config, "float32"))
    model = jmoe.load(mxfp4_gpt_oss, progress=False)
    with ExpertReader(mxfp4_gpt_oss, headers.config) as reader:
        for layer, block in zip(reader.layers, model.module().moe_blocks()):
            for e in range(reader.num_experts):
                for name, value in reader.read(layer, e).items():
                    assert_bitwise_equal(value, np.asarray(getattr(block.experts, name)[...])[e], f"{layer} {e} {name}")


# ---- byte ranges ----

@pytest.mark.parametrize("checkpoint", ["sharded_mixtral", "mxfp4_gpt_oss"])
def test_a_read_takes_exactly_the_experts_bytes(checkpoint, request, monkeypatch):
    directory = request.getfixturevalue(checkpoint)
    cfg = read_headers(directory).config
    with ExpertReader(directory, cfg) as reader:
        for layer in reader.layers:
            for e in range(cfg.num_experts):
                log = PreadLog(monkeypatch)
                reader.read(layer, e)
                wanted = expert_ranges(directory, layer, e, cfg.num_experts)
                got = merged((path, offset, offset + n) for path, offset, n in log.reads)
                assert got == merged(wanted), (layer, e)  # each wanted byte once, nothing else
                total = sum(n for _, _, n in log.reads)
                assert total == reader.checkpoint_bytes(layer, e)
                size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
                assert total * cfg.num_experts * len(reader.layers) < size


# ---- faults ----

def small_reader(directory: Path, **kwargs) -> ExpertReader:
    return ExpertReader(directory, load_config(directory), **kwargs)


def expert_tensor(directory: Path, layer: int, expert: int) -> tuple[str, Path, int, int]:
    name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight"
    path, begin, end, _ = header_entries(directory)[name]
    return name, path, begin, end


def test_a_file_truncated_after_construction_is_an_error_naming_file_and_tensor(small_mixtral_copy):
    name, path, begin, _ = expert_tensor(small_mixtral_copy, 1, 2)
    with small_reader(small_mixtral_copy) as reader:
        reader.read(1, 2)
        os.truncate(path, begin + 10)
        with pytest.raises(CheckpointError, match=rf"{quoted(path)}: the file changed .*{quoted(name)}"):
            reader.read(1, 2)
        with pytest.raises(CheckpointError, match="the file changed"):
            reader.read(0, 0)  # every expert of the file, read before or not


def test_a_file_truncated_before_construction_is_refused(small_mixtral_copy):
    _, path, begin, _ = expert_tensor(small_mixtral_copy, 1, 2)
    os.truncate(path, begin + 10)
    with pytest.raises(CheckpointError, match=rf"{quoted(path)}: .*experts\.\d\.w\d\.weight.*the file is truncated"):
        small_reader(small_mixtral_copy)


@pytest.mark.quick
def test_a_rewrite_that_keeps_size_and_mtime_fails_the_crc(small_mixtral_copy):
    name, path, begin, end = expert_tensor(small_mixtral_copy, 0, 1)
    with small_reader(small_mixtral_copy) as reader:
        first = reader.read(0, 1)
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(begin)
            original = f.read(end - begin)
            f.seek(begin)
            f.write(bytes(b ^ 0x40 for b in original))  # other numbers, same length
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        for _ in range(2):  # every later read, not just the next
            with pytest.raises(CheckpointError,
                               match=rf"{quoted(path)}: the bytes of layer 0 expert 1 .*{quoted(name)}.*CRC-32"):
                reader.read(0, 1)
        np.testing.assert_array_equal(reader.read(1, 1)["w_down"], loaded_experts(small_mixtral_copy,
                                                                                  reader.cfg)[1]["w_down"][1])
        with open(path, "r+b") as f:  # the original bytes back: the same CRC, the same weights
            f.seek(begin)
            f.write(original)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        for key, value in reader.read(0, 1).items():
            assert_bitwise_equal(value, first[key], key)


def test_a_changed_mtime_is_an_error(small_mixtral_copy):
    name, path, _, _ = expert_tensor(small_mixtral_copy, 0, 3)
    with small_reader(small_mixtral_copy) as reader:
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(CheckpointError, match=rf"{quoted(path)}: the file changed while the model runs: "
                                                  rf".*{quoted(name)}.*"
                                                  r"restore it and load the model again"):
            reader.read(0, 3)


def test_an_oserror_is_retried_and_then_reported_with_the_attempts(small_mixtral_copy, monkeypatch):
    with small_reader(small_mixtral_copy, retries=2) as reader:
        expected = reader.read(1, 0)
        reads = PreadLog(monkeypatch)
        reader.read(1, 0)
        once = PreadLog(monkeypatch, fail=lambda call: call == 1)
        for key, value in reader.read(1, 0).items():
            assert_bitwise_equal(value, expected[key], key)
        assert once.calls == reads.calls + 1 and len(once.reads) == reads.calls  # one failed attempt, then the reads
        always = PreadLog(monkeypatch, fail=lambda call: True)
        name, path, _, _ = expert_tensor(small_mixtral_copy, 1, 0)
        with pytest.raises(CheckpointError, match=rf"{quoted(path)}: reading .*{quoted(name)}.* failed 3 times "
                                                  r"\(3 attempts: 1 \+ "
                                                  r"retries=2\); last error: .*Input/output error"):
            reader.read(1, 0)
        assert always.calls == 3
    with small_reader(small_mixtral_copy, retries=0) as reader:
        never = PreadLog(monkeypatch, fail=lambda call: True)
        with pytest.raises(CheckpointError, match=r"failed 1 times \(1 attempts"):
            reader.read(0, 0)
        assert never.calls == 1


def test_partial_reads_are_continued_and_an_early_end_is_an_error(small_mixtral_copy, monkeypatch):
    with small_reader(small_mixtral_copy) as reader:
        expected = reader.read(0, 2)
        drip = PreadLog(monkeypatch, limit=100)  # the kernel may return fewer bytes than asked
        for key, value in reader.read(0, 2).items():
            assert_bitwise_equal(value, expected[key], key)
        assert len(drip.reads) > 10
        monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)  # the end of the file, size unchanged
        name, path, begin, _ = expert_tensor(small_mixtral_copy, 0, 2)
        with pytest.raises(CheckpointError,
                           match=rf"{quoted(path)}: the file ends at byte {begin} inside .*{quoted(name)}.*truncated"):
            reader.read(0, 2)


@pytest.mark.quick
def test_bad_arguments_are_clear_errors(hf_checkpoints, small_mixtral_dir):
    directory = hf_checkpoints["qwen2_moe_shared_dense"][0]  # layer 1 is dense
    with small_reader(directory) as reader:
        assert reader.layers == (0, 2)
        with pytest.raises(InputError, match=r"layer 1 expert 0 is not a routed expert .*MoE layers are \[0, 2\], "
                                             r"experts 0..5"):
            reader.submit(1, 0)
        with pytest.raises(InputError, match="layer 0 expert 6 is not a routed expert"):
            reader.read(0, 6)
        with pytest.raises(InputError, match="layer True expert 0"):
            reader.read(True, 0)
    for kwargs, match in (({"threads": 0}, "threads must be a whole number >= 1"),
                          ({"retries": -1}, "retries must be a whole number >= 0")):
        with pytest.raises(InputError, match=match):
            small_reader(small_mixtral_dir, **kwargs)


# ---- lifecycle ----

@pytest.mark.quick
def test_close_stops_the_threads_and_closes_every_file(sharded_mixtral):
    assert not reader_threads()
    before, files = open_files(), sorted(str(p) for p in sharded_mixtral.glob("*.safetensors"))
    reader = small_reader(sharded_mixtral, threads=3)
    held = open_files()
    for target in set(held) | set(before):
        assert held.count(target) == before.count(target) + (target in files), target  # each file once, kept
    futures = [reader.submit(layer, e) for layer in reader.layers for e in range(4) for _ in range(3)]
    concurrent.futures.wait(futures)
    assert len(reader_threads()) == 3 + 3 // 2 + 3  # reads (half again kept for demand reads), their pieces
    reader.close()
    assert not reader_threads() and open_files() == before
    reader.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed; experts cannot be read after close"):
        reader.read(0, 0)
    with pytest.raises(RuntimeError, match="is closed"):
        reader.submit(1, 3)
    with small_reader(sharded_mixtral) as reader:
        reader.read(1, 1)
    assert not reader_threads() and open_files() == before


def test_a_reader_nobody_closed_releases_its_files_and_threads_when_collected(sharded_mixtral):
    before = open_files()
    reader = small_reader(sharded_mixtral, threads=2)
    reader.read(0, 1)
    threads = reader_threads()
    assert threads and open_files() != before
    del reader
    gc.collect()
    for thread in threads:  # the pool's threads end once the pool is collected
        thread.join(timeout=10)
    assert not reader_threads() and open_files() == before


def test_close_with_reads_queued_cancels_or_finishes_each(sharded_mixtral):
    before = open_files()
    reader = small_reader(sharded_mixtral, threads=1)
    futures = [reader.submit(layer, e) for _ in range(20) for layer in reader.layers for e in range(4)]
    reader.close()
    for future in futures:
        assert future.done() and (future.cancelled() or set(future.result()) == {"w_gate_up", "w_down"})
    assert not reader_threads() and open_files() == before


def test_many_concurrent_reads_all_complete_with_the_right_weights(sharded_mixtral):
    cfg = load_config(sharded_mixtral)
    expected = loaded_experts(sharded_mixtral, cfg)
    with ExpertReader(sharded_mixtral, cfg, threads=8) as reader:
        keys = [(layer, e) for _ in range(8) for layer in reader.layers for e in range(4)]
        futures = [reader.submit(*key) for key in keys]
        done, pending = concurrent.futures.wait(futures, timeout=60)
        assert not pending
        for (layer, e), future in zip(keys, futures):
            for name, value in future.result().items():
                assert_bitwise_equal(value, expected[layer][name][e], f"{layer} {e} {name}")
