"""Serving: continuous batching over one loaded model (`ServingEngine`), and the OpenAI-compatible HTTP server
on top of it (`python -m jmoe.serve`)."""

from jmoe.serve.engine import Request, ServingEngine, TokenEvent
from jmoe.serve.params import QueueFullError, RequestError, RequestParams, generation_defaults

__all__ = ["QueueFullError", "Request", "RequestError", "RequestParams", "ServingEngine", "TokenEvent",
           "generation_defaults"]
