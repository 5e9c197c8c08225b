"""The OpenAI-compatible server (`python -m jmoe.serve`), driven through the official openai client and raw
HTTP: one real server process for the module (warm-up is paid once), plus in-process checks of the API key,
the chat template against transformers and the generate command's defaults."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import re
from typing import Annotated, Literal

import httpx
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

import jmoe
from jmoe.cli.common import DEFAULT_MODEL_DIR

# One pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are expensive, and each
# worker that ran some of its tests would build them again.
pytestmark = pytest.mark.xdist_group("serve_http")

# Two rows share steps as more would; each power of two up to max batch is a set of programs to warm up.
CONTEXT, MAX_BATCH, MAX_QUEUE = 256, 2, 8
READY_DEADLINE = 300  # seconds: load + warm-up on two busy cores
OPENAI_COMPLETION_FIELDS = {"best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                            "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                            "top_p", "user"}
PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self", "import os\n", "for i in range(10):",
           "# Compute the mean\n", "x = [", "return self."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: `python -m jmoe.serve` on a free port, its output in a log file."""

    def __init__(self, log: Path, cache: Path):
        self.port = free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.programs_after_warm_up: float | None = None
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jmoe.serve", "--port", str(self.port), "--max-batch", str(MAX_BATCH),
                 "--max-queue", str(MAX_QUEUE), "--context", str(CONTEXT), "--compile-cache", str(cache)],
                stdout=out, stderr=subprocess.STDOUT,
                # XLA_FLAGS as tests/conftest.py set them: its warm-up compiles ~60 programs.
                env={**os.environ, "JAX_PLATFORMS": "cpu"})

    def wait_ready(self) -> "Server":
        end = time.monotonic() + READY_DEADLINE
        while self.programs_after_warm_up is None:
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}):\n{self.log_tail()}"
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    self.programs_after_warm_up = self.metric("jmoe:compiled_programs")
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, f"not ready after {READY_DEADLINE} s:\n{self.log_tail()}"
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_idle(self, deadline: float = 30) -> None:
        end = time.monotonic() + deadline
        while self.metric("jmoe:num_requests_running") or self.metric("jmoe:num_requests_waiting"):
            assert time.monotonic() < end, f"requests still running after {deadline} s:\n{self.log_tail()}"
            time.sleep(0.1)

    def complete(self, prompt, **kwargs):
        extra = {name: kwargs.pop(name) for name in list(kwargs) if name not in OPENAI_COMPLETION_FIELDS}  # vLLM's
        return self.client.completions.create(model="default", prompt=prompt, extra_body=extra, **kwargs)


class Servers:
    """The module's server, started at once (so the reference model loads meanwhile) and again only if a test
    stopped it (the SIGTERM test, last in the file, stops it; run without xdist's loadgroup, each worker would
    have its own)."""

    def __init__(self, directory: Path, cache: Path):
        self.directory, self.cache = directory, cache
        self.all = [Server(directory / "server-0.log", cache)]

    def current(self) -> Server:
        if self.all[-1].process.poll() is not None and self.all[-1].programs_after_warm_up is not None:
            self.all.append(Server(self.directory / f"server-{len(self.all)}.log", self.cache))
        return self.all[-1].wait_ready()

    def stop(self) -> None:
        for server in self.all:
            server.stop()
            print(f"{server.log} (tail):\n{server.log_tail()}", file=sys.stderr)  # shown when a test failed


@pytest.fixture(scope="module")
def servers(tmp_path_factory, request):
    cache = request.config.cache.mkdir("jmoe_serve_compile_cache")  # faster on the next run; not the user's
    servers = Servers(tmp_path_factory.mktemp("serve"), cache)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def reference():
    """The default model in this process, for tokens the server must reproduce."""
    return jmoe.load(DEFAULT_MODEL_DIR, progress=False)


@pytest.fixture
def server(servers, reference):
    return servers.current()


def test_health_ready_models(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert 0 < ready.json()["compiled_programs"] <= ready.json()["programs"]
    assert [m.id for m in server.client.models.list().data] == ["default"]
    assert server.client.models.retrieve("default").id == "default"
    unknown = httpx.get(server.url + "/v1/models/other")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert server.programs_after_warm_up > 0
    # The probes are polled every half second until ready; uvicorn logs none of them, but logs other requests.
    log = server.log.read_text(errors="replace")
    assert "GET /ready" not in log and "GET /health" not in log and "GET /v1/models" in log
    assert re.search(r"compiled \d+ of \d+ programs \(", log)


def test_greedy_completion_equals_generate(server, reference):
    prompt = PROMPTS[0]
    ids = reference.tokenizer.encode(prompt)
    expected = reference.generate(ids, 24)[0]
    out = server.complete(prompt, max_tokens=24)
    assert out.choices[0].text == reference.tokenizer.decode(expected)
    assert out.choices[0].finish_reason == ("stop" if 0 in expected else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(expected))
    assert out.usage.total_tokens == len(ids) + len(expected)
    by_ids = server.complete(ids, max_tokens=24)  # the same prompt as token ids
    assert by_ids.choices[0].text == out.choices[0].text


def test_a_conversations_next_turn_reuses_its_prefix_and_answers_as_a_fresh_prefill(server, reference):
    """Turn 2 resends turn 1's prompt and answer: the row that answered still holds their keys and values, so only
    the rest is prefilled (usage.prompt_tokens_details.cached_tokens, the metrics), and the answer is generate's."""
    turn1 = reference.tokenizer.encode(PROMPTS[1] * 3)
    answer1 = reference.generate(turn1, 8)[0]
    assert server.complete(turn1, max_tokens=8).choices[0].text == reference.tokenizer.decode(answer1)
    turn2 = turn1 + answer1 + reference.tokenizer.encode(PROMPTS[2])
    reused, computed = (server.metric(f"jmoe:prompt_tokens_{kind}_total") for kind in ("reused", "computed"))
    answer2 = server.complete(turn2, max_tokens=12)
    assert answer2.choices[0].text == reference.tokenizer.decode(reference.generate(turn2, 12)[0])
    cached = answer2.usage.prompt_tokens_details.cached_tokens
    assert cached == len(turn1) + len(answer1) - 1  # the last generated token was never fed back
    assert server.metric("jmoe:prompt_tokens_reused_total") - reused == cached
    assert server.metric("jmoe:prompt_tokens_computed_total") - computed == len(turn2) - cached


def test_streamed_completion_equals_whole(server):
    whole = server.complete(PROMPTS[1], max_tokens=20)
    chunks = list(server.complete(PROMPTS[1], max_tokens=20, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_chat_completion_streamed_and_not(server, reference):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    rendered = ("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nSort a list.<|im_end|>\n"
                "<|im_start|>assistant\n")
    whole = server.client.chat.completions.create(model="default", messages=messages, max_completion_tokens=16)
    assert whole.usage.prompt_tokens == len(reference.tokenizer.encode(rendered))
    assert whole.choices[0].message.role == "assistant"
    chunks = list(server.client.chat.completions.create(model="default", messages=messages, max_tokens=16,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_n_choices_take_derived_seeds(server):
    out = server.complete(PROMPTS[2], n=3, max_tokens=16, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1, "three sampled choices should not all agree"
    single = server.complete(PROMPTS[2], max_tokens=16, temperature=1.0, seed=7)
    assert single.choices[0].text == out.choices[0].text  # choice j is seeded seed + j
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt is counted once
    two_prompts = server.complete([PROMPTS[0], PROMPTS[1]], n=2, max_tokens=4)
    assert [c.index for c in two_prompts.choices] == [0, 1, 2, 3]
    assert two_prompts.choices[0].text == two_prompts.choices[1].text != two_prompts.choices[2].text


def test_seeded_sampling_repeats_alone_and_beside_traffic(server):
    def seeded():
        return server.complete(PROMPTS[3], max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=123,
                               presence_penalty=0.5, frequency_penalty=0.3).choices[0].text

    first = seeded()
    assert seeded() == first
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(server.complete, p, max_tokens=24, temperature=1.0) for p in PROMPTS[4:]]
        busy = pool.submit(seeded)
        assert busy.result() == first
        [f.result() for f in others]


def test_concurrent_requests_equal_their_solo_runs(server):
    solo = [server.complete(p, max_tokens=12).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more than --max-batch: some wait for a row
        together = list(pool.map(lambda p: server.complete(p, max_tokens=12).choices[0].text, PROMPTS))
    assert together == solo


def test_stop_strings_cut_the_text(server):
    text = server.complete(PROMPTS[0], max_tokens=24, ignore_eos=True).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = server.complete(PROMPTS[0], max_tokens=24, ignore_eos=True, stop=stop).choices[0]
    assert (cut.text, cut.finish_reason) == (text[:text.index(stop)], "stop")
    listed = server.complete(PROMPTS[0], max_tokens=24, ignore_eos=True, stop=["@@never@@", stop])
    assert listed.choices[0].text == cut.text
    streamed = server.complete(PROMPTS[0], max_tokens=24, ignore_eos=True, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_logprobs(server):
    out = server.complete(PROMPTS[0], max_tokens=8, logprobs=3).choices[0].logprobs
    assert len(out.tokens) == len(out.token_logprobs) == len(out.top_logprobs) == 8
    for logprob, top in zip(out.token_logprobs, out.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    chat = server.client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


class Pet(BaseModel):
    """What chat.completions.parse asks for: an enum, bounded integers, a boolean, bounded strings and lists."""

    kind: Literal["cat", "dog", "parrot"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    name: str = Field(max_length=12)
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


def test_structured_outputs_always_parse(server):
    """The shipped tiny model answers in the schema's shape, greedy or sampled, through the openai client's parse
    helper (response_format json_schema, strict); json_object output is JSON; vLLM's fields on completions."""
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    for settings in ({}, {"temperature": 1.0, "seed": 11}, {"temperature": 1.0, "seed": 12, "top_p": 0.9}):
        parsed = server.client.chat.completions.parse(model="default", messages=messages, response_format=Pet,
                                                      max_completion_tokens=200, **settings)
        pet = parsed.choices[0].message.parsed
        assert isinstance(pet, Pet), parsed.choices[0].message.content
        assert parsed.choices[0].finish_reason == "stop"
    anything = server.client.chat.completions.create(model="default", messages=messages, max_tokens=200,
                                                     response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert anything.choices[0].message.content.startswith("{")
    choice = server.complete(PROMPTS[0], max_tokens=8, guided_choice=["yes", "no", "maybe"])
    assert choice.choices[0].text in ("yes", "no", "maybe")
    regex = server.complete(PROMPTS[1], max_tokens=12, temperature=1.0, seed=2,
                            structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    streamed = server.complete(PROMPTS[0], max_tokens=20, stream=True,
                               guided_json={"type": "array", "items": {"type": "boolean"}, "maxItems": 2})
    assert isinstance(json.loads("".join(c.choices[0].text for c in streamed)), list)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}


def test_tool_calls_required_named_none_and_a_result_turn(server):
    """The shipped tiny model answers required and named tool_choice with valid calls (constrained), streamed as
    delta.tool_calls; none and auto leave its text as content; the call and the tool's result render back."""
    from transformers import AutoTokenizer

    ask = [{"role": "user", "content": "Weather in Paris?"}]
    create = server.client.chat.completions.create
    named = create(model="default", messages=ask, tools=[WEATHER, CLOCK], max_tokens=48,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    call, = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content, call.type, call.function.name) == \
        ("tool_calls", None, "function", "get_weather")
    assert call.id.startswith("call_") and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    chunks = list(create(model="default", messages=ask, tools=[WEATHER, CLOCK], max_tokens=48, stream=True,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "function", "get_weather", call.function.arguments)]  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and not any(c.choices[0].delta.content for c in chunks)
    required = create(model="default", messages=ask, tools=[WEATHER, CLOCK], max_tokens=56, tool_choice="required",
                      parallel_tool_calls=False).choices[0]
    call_of_choice, = required.message.tool_calls
    arguments = json.loads(call_of_choice.function.arguments)
    assert (arguments == {}) if call_of_choice.function.name == "clock" else (arguments["city"] in ("Paris", "Oslo"))
    assert required.finish_reason == "tool_calls"
    assert server.metric('jmoe:constrained_requests_total{kind="tool_calls"}') >= 3
    none = create(model="default", messages=ask, tools=[WEATHER, CLOCK], max_tokens=12, tool_choice="none")
    auto = create(model="default", messages=ask, tools=[WEATHER, CLOCK], max_tokens=12)  # the model writes no call
    assert none.choices[0].message.tool_calls is None and auto.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == auto.choices[0].message.content
    streamed = create(model="default", messages=ask, tools=[WEATHER, CLOCK], max_tokens=12, tool_choice="none",
                      stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == none.choices[0].message.content
    # The result turn, the assistant's message sent back as the client returned it. Without the tools (their
    # ~100 tokens and the turn's do not fit together in this server's 256-token context): the call still renders.
    turn = ask + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    answer = create(model="default", messages=turn, max_tokens=8)
    as_sent = ask + [{"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}, turn[-1]]
    expected = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).apply_chat_template(as_sent, add_generation_prompt=True)
    assert answer.usage.prompt_tokens == len(expected["input_ids"])
    for body, param in [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"messages": ask + [{"role": "assistant", "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}]}]},
                         "messages.1.tool_calls.0.function.arguments")]:
        response = post(server, "/v1/chat/completions", {"model": "default", "messages": ask, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_logit_bias_bans_and_forces_a_token(server, reference):
    logits = np.asarray(reference.logits([reference.tokenizer.encode(PROMPTS[0])])[0, -1])
    first, second = map(int, np.argsort(-logits)[:2])
    banned = server.complete(PROMPTS[0], max_tokens=1, logit_bias={str(first): -100})
    assert banned.choices[0].text == reference.tokenizer.decode([second])  # greedy: the next most likely
    forced = server.complete(PROMPTS[0], max_tokens=3, temperature=1.0, logit_bias={"7": 100}, ignore_eos=True)
    assert forced.choices[0].text == reference.tokenizer.decode([7, 7, 7])
    for empty in (None, {}):
        assert server.complete(PROMPTS[0], max_tokens=2, logit_bias=empty).usage.completion_tokens == 2


def test_every_openai_and_vllm_field_is_accepted(server):
    """Fields that change nothing here, vLLM's extensions, and a field nobody defines (logged once, ignored)."""
    common = {
        "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
        "prompt_cache_key": "c", "frequency_penalty": None, "presence_penalty": 0.0, "seed": 3, "top_p": 1.0,
        "logit_bias": None, "stop": None, "n": 1, "stream": False, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.0, "min_tokens": 1, "stop_token_ids": [1], "include_stop_str_in_output": False,
        "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "allowed_token_ids": None, "truncate_prompt_tokens": 20, "length_penalty": 1.0, "use_beam_search": False,
        "priority": 0, "request_id": "r1", "cache_salt": "salt", "kv_transfer_params": None, "vllm_xargs": {},
        "return_token_ids": False, "stream_interval": 1, "response_format": {"type": "text"},
        "guided_decoding_backend": "xgrammar", "bad_words": ["lambda"], "no_such_field_anywhere": 1,
    }
    completion = post(server, "/v1/completions", {
        "model": "default", "prompt": PROMPTS[0], "max_tokens": 4, "echo": True, "best_of": 1, "suffix": None,
        "logprobs": None, "add_special_tokens": True, **common})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"].startswith(PROMPTS[0])  # echo
    chat = post(server, "/v1/chat/completions", {
        "model": "default", "max_completion_tokens": 4, "logprobs": False, "top_logprobs": None,
        "parallel_tool_calls": True, "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low", "verbosity": "low", "stream_options": None, "add_generation_prompt": True,
        "continue_final_message": False, "chat_template_kwargs": {"enable_thinking": False}, "echo": False,
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}], **common})
    assert chat.status_code == 200, chat.text
    assert "ignored fields no schema defines: no_such_field_anywhere" in server.log_tail(20000)


def test_stream_usage_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    chunks = list(server.complete(PROMPTS[2], max_tokens=6, stream=True, ignore_eos=True, echo=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].text == PROMPTS[2]  # echo: the prompt comes first
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 6


def post(server, path, body, **kwargs):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=60,
                      **kwargs)


@pytest.mark.parametrize("body, status, param", [
    ('{"model": "default", "prompt": "x"', 400, None),  # malformed JSON
    ({"model": "default", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),  # a string for a number
    ({"model": "default", "prompt": 5}, 400, "prompt"),
    ({"model": "default", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "default", "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "default", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "default", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "default", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),  # not a token id
    ({"model": "default", "prompt": "x", "logit_bias": {"5000": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ({"model": "default", "prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias.5"),  # strict types
    ({"model": "default", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"model": "default", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "default", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"model": "default", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "default", "prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"model": "default", "prompt": "x", "echo": True, "logprobs": 2}, 400, "echo"),
    ({"model": "default", "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ({"model": "default", "prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"model": "default", "prompt": "x", "guided_regex": "("}, 400, "guided_regex"),  # the engine names why
    ({"model": "default", "prompt": "x", "guided_json": {"type": "string", "format": "nope"}}, 400, "guided_json"),
    ({"model": "default", "prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}, 400, "guided_choice"),
    ({"model": "default", "prompt": [5000]}, 400, "prompt"),  # outside the vocabulary
    ({"model": "default", "prompt": "x " * 1000}, 400, "prompt"),  # longer than the context
    ({"model": "default", "prompt": "def f(x):\n" * 100_000}, 400, "prompt"),  # 1 MB
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
])
def test_bad_completion_requests(server, body, status, param):
    response = post(server, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_bad_chat_requests(server):
    too_many = post(server, "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                                                     "top_logprobs": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"
    wrong_type = post(server, "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": 1}]})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "messages.0.content"
    over = post(server, "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": CONTEXT})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_completion_tokens"
    # What jmoe cannot serve is named: images, audio in or out, a schema the grammar engine cannot compile.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for body, param, words in [
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]},
             "messages.0.content.1", "image_url"),
            ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA",
                                                                                             "format": "wav"}}]}]},
             "messages.0.content.0", "input_audio"),
            ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, "modalities", "audio"),
            ({"messages": [{"role": "user", "content": "x"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"}}}},
             "response_format.json_schema.schema", "nope")]:
        response = post(server, "/v1/chat/completions", {"model": "default", **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error


def open_streams(server, count: int, max_tokens: int = CONTEXT - 16) -> list[socket.socket]:
    """`count` raw streaming requests, each read up to its status line (so the server has taken it)."""
    body = json.dumps({"model": "default", "prompt": PROMPTS[0], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    sockets = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(request)
        sockets.append(s)
    for s in sockets:
        assert s.recv(12).startswith(b"HTTP/1.1")
    return sockets


def test_full_queue_is_503_with_retry_after(server):
    sockets = []
    try:
        while server.metric("jmoe:num_requests_waiting") < MAX_QUEUE:  # a few may be refused before rows fill
            assert len(sockets) < 3 * (MAX_BATCH + MAX_QUEUE), "the waiting queue never filled"
            sockets += open_streams(server, 1)
        response = post(server, "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1})
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
    finally:
        for s in sockets:
            s.close()
    server.wait_idle()


def test_disconnect_mid_stream_frees_the_row(server):
    cancelled = server.metric('jmoe:requests_finished_total{finish_reason="cancelled"}')
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "default", "prompt": PROMPTS[0], "max_tokens": CONTEXT - 8, "ignore_eos": True,
                            "stream": True}) as response:
        next(response.iter_lines())
    server.wait_idle()
    assert server.metric('jmoe:requests_finished_total{finish_reason="cancelled"}') == cancelled + 1


def test_hundred_dropped_requests(server):
    sockets = open_streams(server, 100)
    for s in sockets:
        s.close()
    server.wait_idle()
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.complete(PROMPTS[0], max_tokens=2).usage.completion_tokens == 2


def test_every_program_compiles_once_behind_the_requests(server):
    """The server answered once the programs of small requests existed and compiled the rest behind the tests'
    traffic: in the end every program of the engine's set is compiled, and nothing else."""
    deadline = time.monotonic() + READY_DEADLINE
    while (status := httpx.get(server.url + "/ready").json())["compiled_programs"] < status["programs"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert server.metric("jmoe:compiled_programs") == status["programs"] >= server.programs_after_warm_up
    assert server.metric('jmoe:constrained_requests_total{kind="json_schema"}') > 0
    assert server.metric("jmoe:grammar_mask_seconds_count") > 0
    assert server.metric('jmoe:step_seconds_count{kind="decode"}') > 0
    assert server.metric("jmoe:decode_distinct_experts_count") > 0
    assert server.metric("jmoe:time_to_first_token_seconds_count") > 0


def test_sigterm_drains_and_exits_0(server):
    """Last: it stops the module's server."""
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "default", "prompt": PROMPTS[0], "max_tokens": 64, "ignore_eos": True,
                            "stream": True}) as response:
        stream = response.iter_lines()
        lines.append(next(stream))
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = post(server, "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 1}).status_code
        except httpx.TransportError:
            late = "refused"
        lines.extend(stream)
    assert late in (503, "refused")
    lines = [line for line in lines if line]  # events are separated by blank lines
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(60) == 0, server.log_tail()


# ---- in-process ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def client_of_a_loading_server(**options):
    """A TestClient of create_app(**options) for model "m", whose model never finishes loading (released on exit)."""
    from fastapi.testclient import TestClient

    from jmoe.serve.http import create_app

    gate = threading.Event()

    def never_loads(observer):
        gate.wait()
        raise RuntimeError("this test loads no model")

    try:
        with TestClient(create_app(never_loads, "m", **options)) as client:
            yield client
    finally:
        gate.set()


@pytest.mark.quick
def test_api_key_guards_v1_only():
    with client_of_a_loading_server(api_key="secret") as client:
        assert client.get("/health").status_code == 200
        not_ready = client.get("/ready")
        assert not_ready.status_code == 503 and not_ready.json() == {"status": "not ready", "reason": "loading"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            response = client.get("/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer secret"}
        assert client.get("/v1/models", headers=good).json()["data"][0]["id"] == "m"
        loading = client.post("/v1/completions", headers=good, json={"model": "m", "prompt": "x"})
        assert loading.status_code == 503 and loading.headers["Retry-After"] == "1"


@pytest.mark.quick
def test_request_fields_become_engine_parameters():
    """Without a server: OpenAI's and vLLM's fields as RequestParams (vLLM's top_k -1, logit_bias keys and clamp,
    a seed outside 32 bits, a temperature above OpenAI's 2, bad words tokenized), echo's text per choice,
    structured outputs' one source, and the 400s for what cannot be served, each naming its field."""
    from jmoe.checkpoint.tokenizer import load_tokenizer
    from jmoe.serve.chat import load_chat_template
    from jmoe.serve.grammar import Grammars
    from jmoe.serve.openai_api import ChatBody, CompletionBody, Served, chat_generation, completion_generation
    from jmoe.serve.params import RequestError

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    served = Served(tokenizer, CONTEXT, 8, load_chat_template(DEFAULT_MODEL_DIR), {"temperature": 0.0},
                    Grammars(tokenizer, 4096, [0]))
    body = CompletionBody.model_validate({
        "model": "m", "prompt": ["ab", "cd"], "n": 2, "echo": True, "top_k": -1, "min_p": 0.2, "seed": -1,
        "repetition_penalty": 1.1, "logit_bias": {"5": -150, "9": 2}, "min_tokens": 2, "stop_token_ids": [3],
        "bad_words": ["pass"], "include_stop_str_in_output": True, "guided_choice": ["x", "y"], "temperature": 3})
    generation = completion_generation(body, served)
    params = generation.choices[0][1]
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (0, 0.2, 1.1, 2)
    assert params.temperature == 3
    assert params.logit_bias == ((5, -100.0), (9, 2.0)) and params.stop_token_ids == (3,)  # vLLM's clamp
    assert params.seed == 2**32 - 1 and generation.choices[1][1].seed == 0  # -1 mod 2^32, then seed + 1
    assert tokenizer.encode(" pass", add_special_tokens=False) in [list(w) for w in params.bad_words]
    assert params.constraint.kind == "choice" and generation.echo == ["ab", "ab", "cd", "cd"]
    chat = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                    "response_format": {"type": "json_object"}, "metadata": {"a": "b"}})
    assert chat_generation(chat, served).choices[0][1].constraint.kind == "json_object"
    for fields, param in [({"suffix": "z"}, "suffix"), ({"best_of": 2}, "best_of"),
                          ({"echo": True, "logprobs": 1}, "echo"), ({"prompt_logprobs": 2}, "prompt_logprobs"),
                          ({"guided_json": {}, "response_format": {"type": "json_object"}}, "guided_json"),
                          ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs")]:
        with pytest.raises(RequestError) as error:
            completion_generation(CompletionBody.model_validate({"model": "m", "prompt": "x", **fields}), served)
        assert error.value.param == param, fields


@pytest.mark.quick
def test_strict_fields_answers_400_to_a_field_nobody_defines():
    with client_of_a_loading_server(strict_fields=True) as client:
        body = {"model": "m", "prompt": "x", "stream_options": {"include_usage": True, "colour": "red"}}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options.colour"
        known = client.post("/v1/completions", json={"model": "m", "prompt": "x", "store": True, "min_p": 0.1})
        assert known.status_code == 503  # accepted: only the model is missing


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "déjà vu?"},
     {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Again\n\nplease"}],
]
# A template using what transformers gives one: bos/eos tokens, raise_exception, loop controls, tojson.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% set offset = 1 if messages[0]['role'] == 'system' else 0 %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if (m['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}\n"
    "  [{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token if m['role'] == 'assistant' }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.mark.quick
def test_chat_templates_render_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    from jmoe.serve.chat import load_chat_template
    from jmoe.serve.params import RequestError

    strict = tmp_path / "strict"
    strict.mkdir()
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    (strict / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": STRICT_TEMPLATE}))
    (strict / "tokenizer.json").write_bytes((DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes())
    for directory in (DEFAULT_MODEL_DIR, strict):
        ours, theirs = load_chat_template(directory), AutoTokenizer.from_pretrained(directory)
        for conversation in CONVERSATIONS:
            expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            assert ours.render(conversation) == expected
    with pytest.raises(RequestError, match="roles must alternate"):
        load_chat_template(strict).render([{"role": "assistant", "content": "first"}])
    # vLLM's chat_template_kwargs and documents, as apply_chat_template passes its keyword arguments
    (strict / "chat_template.jinja").write_text(
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
        "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}] {% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    documents = [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]
    expected = AutoTokenizer.from_pretrained(strict).apply_chat_template(
        CONVERSATIONS[0], tokenize=False, add_generation_prompt=True, documents=documents, enable_thinking=False)
    assert load_chat_template(strict).render(CONVERSATIONS[0], None, documents, {"enable_thinking": False,
                                                                                  "messages": []}) == expected
    assert expected.startswith("/no_think [a: first] [b: second] ")


@pytest.mark.quick
def test_chat_without_a_template_is_a_clear_400(tmp_path):
    from jmoe.serve.chat import load_chat_template
    from jmoe.serve.openai_api import ChatBody, Served, chat_generation
    from jmoe.serve.params import RequestError

    assert load_chat_template(tmp_path) is None
    body = ChatBody(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="no chat template") as error:
        chat_generation(body, Served(None, CONTEXT, 8, None, {}))
    assert error.value.param == "messages"


@pytest.mark.quick
def test_generate_cli_takes_generation_config_defaults(tmp_path):
    from jmoe.cli.generate import build_parser, sampling_params
    from jmoe.decode.sampling import SamplingParams

    parse = build_parser().parse_args
    assert sampling_params(parse([]), DEFAULT_MODEL_DIR) == SamplingParams(0.0, 0, 1.0)  # do_sample false
    assert sampling_params(parse([]), tmp_path) == SamplingParams(0.0, 0, 1.0)  # no file: greedy
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.9}')
    assert sampling_params(parse([]), tmp_path) == SamplingParams(0.6, 0, 0.9)
    assert sampling_params(parse(["--temperature", "0", "--top-k", "5"]), tmp_path) == SamplingParams(0.0, 5, 0.9)
