"""The OpenAI-compatible HTTP API over a ServingEngine (FastAPI): `create_app`.

Endpoints: GET /v1/models and /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events with `stream: true`), GET /health (the process answers), GET /ready (the model is loaded and
the programs of small requests compiled; its body says how many of all, and about how long the rest take), GET /metrics (Prometheus). With an API key, /v1/* need `Authorization: Bearer KEY`;
/health, /ready and /metrics stay open. Errors have OpenAI's shape (jmoe.serve.errors). A body field no schema
defines is logged once per request and ignored, as vLLM does; with `strict_fields` it is a 400.

The model is loaded and warmed up on a background thread once the server runs, so /health answers at once
and requests get 503 until /ready does. Engine events cross into asyncio through `call_soon_threadsafe`; a
client that disconnects cancels its requests, freeing their rows at the engine's next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import secrets
import threading
import time
from typing import Callable

from fastapi import APIRouter, Depends, FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from jmoe.serve.chat import load_chat_template
from jmoe.serve.engine import Request, ServingEngine, TokenEvent
from jmoe.serve.errors import ApiError, install_error_handlers
from jmoe.serve.grammar import Grammars
from jmoe.serve.metrics import Metrics
from jmoe.serve.openai_api import (ChatBody, Choice, CompletionBody, Generation, Reply, Served, chat_generation,
                                   completion_generation, unknown_fields, usage)
from jmoe.serve.params import QueueFullError, generation_defaults

RETRY_AFTER_SECONDS = 1
logger = logging.getLogger("jmoe.serve")


class ServerState:
    """The engine once loaded (`loaded`: a future of it), the metrics it reports to, and whether the server
    is shutting down."""

    def __init__(self, make_engine: Callable[[Metrics], ServingEngine], model_name: str, strict_fields: bool = False,
                 compile_behind: bool = True):
        self.make_engine = make_engine
        self.compile_behind = compile_behind
        self.model_name = model_name
        self.strict_fields = strict_fields
        self.metrics = Metrics()
        self.engine: ServingEngine | None = None
        self.served: Served | None = None
        self.loaded: concurrent.futures.Future[ServingEngine] = concurrent.futures.Future()
        self.draining = False
        self.started = int(time.time())

    def load(self) -> None:
        """Build, warm up and start the engine (on a background thread); `loaded` gets it or the error."""
        try:
            engine = self.make_engine(self.metrics)
            model = engine.model
            source = model.source
            grammars = None if model.tokenizer is None else \
                Grammars(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids)
            self.served = Served(model.tokenizer, engine.context, engine.max_batch + engine.max_queue,
                                 None if source is None else load_chat_template(source), generation_defaults(source),
                                 grammars)
            self.metrics.engine = self.engine = engine
            if grammars is not None:
                grammars.prepare()
            engine.start(compile_behind=self.compile_behind)
        except BaseException as error:  # reported by /health, /ready and the command line
            self.loaded.set_exception(error)
            return
        self.loaded.set_result(engine)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self.draining

    def running_engine(self) -> ServingEngine:
        """The engine, or the 503 that says why there is none to take a request."""
        if self.draining:
            raise ApiError(503, "the server is shutting down; send the request to another instance",
                           "server_error", code="shutting_down", retry_after=RETRY_AFTER_SECONDS)
        if not self.ready:
            raise ApiError(503, "the model is still loading and compiling; retry when GET /ready answers 200",
                           "server_error", code="model_loading", retry_after=RETRY_AFTER_SECONDS)
        return self.engine


def create_app(make_engine: Callable[[Metrics], ServingEngine], model_name: str, api_key: str | None = None,
               strict_fields: bool = False, compile_behind: bool = True) -> FastAPI:
    """The server's app. `make_engine(observer)` builds the (not yet started) ServingEngine with that observer;
    it is called on a background thread when the app starts, then the engine is warmed up and started: ready once
    the programs of small requests are compiled, the rest compiled behind them (`compile_behind`; else all first).
    `model_name` is the only model /v1 requests may name; `api_key`, if given, is required on /v1;
    `strict_fields`: a body field no schema defines is a 400 instead of logged and ignored."""
    state = ServerState(make_engine, model_name, strict_fields, compile_behind)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="jmoe-load", daemon=True).start()
        yield
        state.draining = True
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop, True)

    app = FastAPI(title="jmoe", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(_health_routes(state))
    app.include_router(_api_routes(state), dependencies=[Depends(_key_check(api_key))] if api_key else [])
    return app


def _key_check(api_key: str):
    expected = f"Bearer {api_key}".encode()

    def check(request: HttpRequest) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "key this server was started with (--api-key)", "invalid_request_error",
                           code="invalid_api_key")
    return check


def _health_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    def health():
        failure = _failure(state)
        if failure is not None:
            return JSONResponse({"status": "failed", "error": failure}, status_code=503)
        return {"status": "ok"}

    @router.get("/ready")
    def ready():
        """200 once requests are taken; the body (503's too) says how far compiling is."""
        compiling = {} if state.engine is None else state.engine.compile_status()
        if not state.ready:
            reason = "shutting down" if state.draining else _failure(state) or (
                "compiling" if compiling.get("compiled_programs") else "loading")
            return JSONResponse({"status": "not ready", "reason": reason, **compiling}, status_code=503)
        return {"status": "ready", **compiling}

    @router.get("/metrics")
    def metrics():
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


def _failure(state: ServerState) -> str | None:
    """What broke the model's loading or the engine's step loop, if anything did."""
    error = state.loaded.exception() if state.loaded.done() else None
    error = error or (state.engine.failure if state.engine is not None else None)
    return None if error is None else f"{type(error).__name__}: {error}"


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "jmoe"}

    @router.get("/models")
    def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{model_id:path}")
    def model(model_id: str):
        _check_model_name(state, model_id)
        return model_card()

    @router.post("/completions")
    async def completions(body: CompletionBody, http_request: HttpRequest):
        return await _generate(state, body, http_request, completion_generation, chat=False)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatBody, http_request: HttpRequest):
        return await _generate(state, body, http_request, chat_generation, chat=True)

    return router


def _check_model_name(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(404, f"model {name!r} does not exist here; this server serves {state.model_name!r} "
                            f"(GET /v1/models)", "invalid_request_error", "model", "model_not_found")


async def _generate(state: ServerState, body, http_request: HttpRequest, prepare, chat: bool):
    _check_unknown_fields(state, body, http_request.url.path)
    _check_model_name(state, body.model)
    engine = state.running_engine()
    generation: Generation = await run_in_threadpool(prepare, body, state.served)  # tokenizing may take a while
    queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
    requests = _submit(engine, generation, queue)
    watcher = asyncio.create_task(_cancel_on_disconnect(http_request, requests))
    tokenizer = state.served.tokenizer
    reply = Reply(chat, state.model_name, (lambda ids: "") if tokenizer is None else tokenizer.decode,
                  generation.tools)
    if generation.stream:
        return StreamingResponse(_stream(reply, generation, requests, queue, watcher), media_type="text/event-stream")
    try:
        choices = [Choice() for _ in requests]
        async for index, event in _events(queue, len(requests)):
            choices[index].add(event)
    finally:
        _end(requests, watcher)
    failed = [r.error for r in requests if r.finish_reason == "error"]
    if failed:
        raise ApiError(500, f"generation failed: {type(failed[0]).__name__}: {failed[0]}", "server_error")
    return reply.body(choices, usage(generation, requests), generation.echo)


def _check_unknown_fields(state: ServerState, body, path: str) -> None:
    """Fields no schema defines: a 400 under --strict-fields, else one log line for the request (vLLM's way)."""
    unknown = unknown_fields(body)
    if not unknown:
        return
    if state.strict_fields:
        raise ApiError(400, f"unknown field {unknown[0]!r}: this server does not support it and runs with "
                            f"--strict-fields; remove it", "invalid_request_error", unknown[0])
    logger.warning("%s: ignored fields no schema defines: %s", path, ", ".join(unknown))


def _submit(engine: ServingEngine, generation: Generation, queue: asyncio.Queue) -> list[Request]:
    """Submit every choice's engine request; all or none (a full queue cancels those already submitted)."""
    loop = asyncio.get_running_loop()
    requests = []
    try:
        for index, (prompt, params) in enumerate(generation.choices):
            requests.append(engine.submit(prompt, params, _bridge(loop, queue, index)))
    except QueueFullError as e:
        for request in requests:
            request.cancel()
        raise ApiError(503, str(e), "server_error", code="queue_full", retry_after=RETRY_AFTER_SECONDS) from e
    return requests


def _bridge(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
    """The engine thread's `on_event` for choice `index`: hands each event to the event loop."""

    def on_event(event: TokenEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, (index, event))
    return on_event


async def _events(queue: asyncio.Queue, count: int):
    """(choice index, event) until each of `count` choices has finished."""
    finished = 0
    while finished < count:
        index, event = await queue.get()
        finished += event.finish_reason is not None
        yield index, event


async def _cancel_on_disconnect(http_request: HttpRequest, requests: list[Request]) -> None:
    """Wait for the client to go away (the body is already read: the next message is the disconnect), then
    cancel its requests."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
    for request in requests:
        request.cancel()


def _end(requests: list[Request], watcher: asyncio.Task) -> None:
    """The response is over (sent, failed or abandoned): stop watching and cancel what still runs."""
    watcher.cancel()
    for request in requests:
        if not request.done:
            request.cancel()


async def _stream(reply: Reply, generation: Generation, requests: list[Request], queue: asyncio.Queue,
                  watcher: asyncio.Task):
    """Server-sent events: a chat stream's role chunks, a chunk per event with something to say, the usage
    chunk if asked for, then [DONE]. A failed generation ends the stream with an error object."""
    usage_field = generation.include_usage
    try:
        if reply.chat:
            for index in range(len(requests)):
                yield _sse(reply.role_chunk(index, usage_field))
        for index, text in enumerate(generation.echo or ()):
            if text:
                yield _sse(reply.chunk(index, TokenEvent(None, text, None, None, None), usage_field,
                                       _so_far(generation, requests), echo=True))
        async for index, event in _events(queue, len(requests)):
            if event.finish_reason == "error":
                error = requests[index].error
                yield _sse({"error": {"message": f"generation failed: {type(error).__name__}: {error}",
                                      "type": "server_error", "param": None, "code": None}})
                return
            chunk = reply.chunk(index, event, usage_field, _so_far(generation, requests))
            if chunk is not None:
                yield _sse(chunk)
        if usage_field:
            yield _sse(reply.usage_chunk(usage(generation, requests)))
        yield "data: [DONE]\n\n"
    finally:
        _end(requests, watcher)


def _so_far(generation: Generation, requests: list[Request]) -> dict | None:
    """The usage so far, for vLLM's continuous_usage_stats (None without it)."""
    return usage(generation, requests) if generation.continuous_usage else None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

