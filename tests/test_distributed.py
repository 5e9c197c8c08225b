"""Several processes through jax.distributed on 127.0.0.1 (jmoe.distributed): jmoe.eval shards its windows and
reports the one-process result on every process, generation gives every process the same tokens, and bad
settings, an unreachable coordinator or a process that dies end the run with an error instead of a hang. Every
test starts its processes itself and always stops them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import jmoe
from hf_models import write_checkpoint, write_word_tokenizer
from jmoe.distributed import DistributedError, DistributedOptions
from jmoe.eval import evaluate

PROCESS_TIMEOUT_S = 300
SEQ = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("distributed") / "m"
    write_checkpoint(d, "mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                     num_attention_heads=2, num_key_value_heads=1)
    write_word_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def data_file(model_dir):
    path = model_dir.parent / "stream.npy"
    np.save(path, np.random.default_rng(0).integers(0, 64, 11 * SEQ + 5))  # 12 windows, the last one short
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}  # two CPU devices per process
    return subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(processes: list[subprocess.Popen], timeout: float = PROCESS_TIMEOUT_S) -> list[tuple[int, str, str]]:
    """Wait for every process (killing all of them at the deadline); (exit status, stdout, stderr) each."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


def run_together(module: str, args: list[str], processes: int = 2, timeout_s: int = 60) -> list[tuple]:
    address = f"127.0.0.1:{free_port()}"
    return finish([start(["-m", module, *args, "--coordinator", address, "--num-processes", str(processes),
                          "--process-id", str(i), "--coordinator-timeout", str(timeout_s)])
                   for i in range(processes)])


def test_eval_over_two_processes_equals_one_process(model_dir, data_file):
    results = run_together("jmoe.eval", ["--model", str(model_dir), "--data", str(data_file), "--seq-len", str(SEQ),
                                         "--batch-size", "2", "--json", "--no-compile-cache"])
    assert [status for status, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    reports = [json.loads(out) for _, out, _ in results]
    single = evaluate(jmoe.load(model_dir, progress=False), np.load(data_file), batch_size=2, seq_len=SEQ)
    for report in reports:
        assert report["predicted_tokens"] == single.predicted_tokens and report["windows"] == single.windows
        assert report["perplexity"] == pytest.approx(single.perplexity, rel=1e-6)
        assert [r["load"] for r in report["routing"]] == [r.load for r in single.routing]
    # Each process ran only its share: 12 windows in batches of 2 -> three batches each.
    assert all(report["batch_shapes"] == [[2, SEQ]] for report in reports)


@pytest.mark.quick
def test_native_lines_on_descriptor_1_leave_standard_output_to_python():
    # What Gloo does when its first collective connects, from another thread, at a moment nobody chooses.
    script = ("import json, os, threading; from jmoe.distributed import keep_standard_output_for_python; "
              "keep_standard_output_for_python(); "
              "t = threading.Thread(target=os.write, args=(1, b'[Gloo] Rank 1 is connected\\n')); t.start(); t.join(); "
              "print(json.dumps({'perplexity': 1.5}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {"perplexity": 1.5}
    assert "[Gloo] Rank 1 is connected" in done.stderr


@pytest.mark.quick
def test_generation_gives_every_process_the_same_tokens(model_dir):
    results = run_together("jmoe.generate", ["--model", str(model_dir), "--prompt", "w3 w1 w4", "--max-new-tokens", "6",
                                             "--json", "--no-compile-cache"])
    assert [status for status, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    tokens = [json.loads(out)["token_ids"] for _, out, _ in results]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


@pytest.mark.parametrize("options, message", [
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), r"--process-id must be in \[0, 2\)"),
    (dict(coordinator="127.0.0.1:1234", process_id=0), "--num-processes must be a whole number"),
    (dict(coordinator="localhost", num_processes=2, process_id=0), "HOST:PORT"),
    (dict(num_processes=2, process_id=0), "go with --coordinator"),
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=0, timeout_s=0), "timeout"),
])
def test_bad_settings_are_refused_before_joining(options, message):
    with pytest.raises(DistributedError, match=message):
        DistributedOptions(**options)


def test_an_unreachable_coordinator_is_a_clear_error_in_bounded_time(model_dir, data_file):
    began = time.monotonic()
    [(status, _, err)] = finish([start(["-m", "jmoe.eval", "--model", str(model_dir), "--data", str(data_file),
                                        "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                                        "--process-id", "1", "--coordinator-timeout", "3"])], timeout=120)
    assert status == 2 and "did not answer within 3 s" in err, err[-2000:]
    assert time.monotonic() - began < 60


def test_a_process_that_dies_ends_the_others(model_dir, data_file):
    """Process 1 joins and dies at once; process 0, evaluating, is ended by JAX once the heartbeats stop."""
    address = f"127.0.0.1:{free_port()}"
    dies = ("import os, jax; jax.distributed.initialize(%r, 2, 1, initialization_timeout=60, "
            "heartbeat_timeout_seconds=4); os._exit(1)" % address)
    began = time.monotonic()
    evaluating = start(["-m", "jmoe.eval", "--model", str(model_dir), "--data", str(data_file), "--seq-len", str(SEQ),
                        "--coordinator", address, "--num-processes", "2", "--process-id", "0",
                        "--coordinator-timeout", "4"])
    [(status, _, err), (died, _, _)] = finish([evaluating, start(["-c", dies])], timeout=120)
    assert died == 1 and status != 0
    assert "stopped sending heartbeats" in err, err[-2000:]
    assert time.monotonic() - began < 120
