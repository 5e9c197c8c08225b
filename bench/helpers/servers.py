"""OpenAI-compatible servers for benchmarks: jmoe's (`python -m jmoe.serve`) and `transformers serve`, each its own
process on 127.0.0.1 with a log, always stopped; a streamed completion timed token by token; /metrics read."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jmoe_command(port: int, model: Path, model_name: str, max_batch: int, context: int, cache: int | None,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m jmoe.serve` on `port`, `extra` flags appended."""
    return [sys.executable, "-m", "jmoe.serve", "--model", str(model), "--port", str(port),
            "--max-batch", str(max_batch), "--context", str(context), "--served-model-name", model_name,
            *(["--cache", str(cache)] if cache is not None else []), *extra]


def transformers_command(port: int, model: Path, kv_pages: int | None = None,
                         max_batch_tokens: int | None = None) -> list[str]:
    """`transformers serve --continuous-batching` on `port`. `kv_pages`: its paged KV cache's pages of 256 tokens
    (left to it, it sizes the cache from the machine's memory, and allocating and resetting those tensors took ~15 s
    of CPU)."""
    command = [str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", str(model)]
    if kv_pages is not None:
        command += ["--cb-num-blocks", str(kv_pages)]
    if max_batch_tokens is not None:
        command += ["--cb-max-batch-tokens", str(max_batch_tokens)]
    return command


class Server:
    """One server process on 127.0.0.1, started in its own session and always stopped (its whole group). `kind`:
    "jmoe" or "transformers" (how to tell it is ready); `command(port)`: its command line; `name`: what messages
    call it (the kind by default)."""

    def __init__(self, kind: str, command: Callable[[int], list[str]], log_path: Path, model_name: str,
                 name: str | None = None):
        self.kind, self.engine, self.port = kind, name or kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_name = model_name
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command(self.port), stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})

    def wait_ready(self, timeout: float, prompt: str = "def f(x):") -> float:
        """Seconds until the server answers a first completion of `prompt` (jmoe: /ready, then one request)."""
        began = time.monotonic()
        path = "/ready" if self.kind == "jmoe" else "/health"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - began > timeout:
                raise RuntimeError(f"{self.engine} server not ready after {timeout} s; see {self.log.name}")
            time.sleep(0.5)
        # transformers serve loads and compiles on its first request: take that out of the measurements
        with httpx.Client() as client:
            complete(client, self, prompt, 4, timeout=timeout)
        return time.monotonic() - began

    def wait_compiled(self, timeout: float) -> None:
        """jmoe: until /ready says every program is compiled (a server answers once the programs of small requests
        exist and compiles the rest behind them); other servers: at once."""
        began = time.monotonic()
        while self.kind == "jmoe":
            status = httpx.get(self.url + "/ready", timeout=5).json()
            if status.get("compiled_programs", 0) >= status.get("programs", 0):
                return
            if time.monotonic() - began > timeout:
                raise RuntimeError(f"{self.engine} server still compiling after {timeout} s: {status}")
            time.sleep(0.5)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        """jmoe's /metrics summed by metric name (labels dropped), and each labelled series under its full name."""
        totals: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name = series.split("{")[0]
                totals[name] = totals.get(name, 0.0) + float(value)
                if series != name:
                    totals[series] = float(value)
        return totals

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def metric_delta(before: dict, after: dict, series: str) -> float:
    """A counter's growth between two jmoe /metrics readings (0 for one neither has)."""
    return after.get(series, 0.0) - before.get(series, 0.0)


def complete(client: httpx.Client, server: Server, prompt: str, max_tokens: int, timeout: float = 300,
             extra_body: dict | None = None, on_token: Callable[[int], bool] | None = None) -> dict:
    """One streamed greedy completion through `client` (its kept-alive connection, as an OpenAI client holds one:
    a new httpx client costs ~20 ms of this process's time, which eight threads starting at once would add to
    each other's TTFT): time to first token, the times between token chunks and their arrival times, the text, the
    tokens generated (the usage chunk's count where the server sends one, else the chunks that carried a token),
    the prompt's tokens and those the server reused (usage.prompt_tokens_details.cached_tokens; 0 where it sends
    none). `extra_body`: more request fields; `on_token(n)`, called as the n-th token arrives: False stops reading
    (the stream is closed, which cancels the request)."""
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra_body or {})}
    began = time.monotonic()
    arrivals, texts, usage = [], [], None
    with client.stream("POST", server.url + "/v1/completions", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.engine}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            choice = (chunk.get("choices") or [None])[0]
            # A chunk carries a token unless it is only the finish of a stream whose last token came before.
            if choice is not None and (choice.get("text") or choice.get("finish_reason") is None):
                arrivals.append(time.monotonic())
                texts.append(choice.get("text") or "")
                if on_token is not None and not on_token(len(arrivals)):
                    break
    if not arrivals:
        raise RuntimeError(f"{server.engine}: a completion produced no token")
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": arrivals[0] - began, "gaps": list(np.diff(arrivals)), "arrivals": arrivals, "began": began,
            "text": "".join(texts), "tokens": usage["completion_tokens"] if usage else len(arrivals),
            "prompt_tokens": usage["prompt_tokens"] if usage else None,
            "cached_tokens": details.get("cached_tokens") or 0}
