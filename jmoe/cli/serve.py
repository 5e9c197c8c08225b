"""Command line: `python -m jmoe.serve [--model DIR]`: an OpenAI-compatible HTTP server with continuous batching.

The socket opens at once (GET /health); the model loads and compiles every program in the background, after
which GET /ready answers 200. SIGTERM or Ctrl-C: new requests get 503, those in flight finish, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

try:
    import uvicorn
except ImportError as e:  # the serve extra is not installed
    raise SystemExit(f"error: python -m jmoe.serve needs the serve extra ({e}); pip install -e '.[serve]'") from e

from jmoe.cli.common import add_model_arg, add_offload_args, load_for_cli, offload_options, resolve_model_dir, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jmoe.serve", description=__doc__.splitlines()[0])
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a batch row; more get 503 (default: %(default)s)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per request, prompt + completion (default: 4096 or the model's "
                        "max_position_embeddings if smaller)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument("--strict-fields", action="store_true",
                   help="answer 400 to a request field no OpenAI or vLLM schema defines (default: log it once per "
                        "request and ignore it, as vLLM does)")
    p.add_argument("--compile-all-first", action="store_true",
                   help="compile every program before answering (default: answer once the programs of small requests "
                        "are compiled and compile the rest behind them; a request that needs one not yet compiled "
                        "waits for it)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the most prompt tokens one prefill step takes per request (default: 256, or where an "
                        "offloaded model's experts stream from host memory per chunk, as on a GPU, long enough to hide "
                        "that stream, up to the context)")
    p.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                   help="prefill every prompt from its first token (default: a prompt skips the longest prefix whose "
                        "keys and values a batch row still holds, e.g. the conversation so far)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name)")
    add_offload_args(p)
    return p


def make_engine_factory(args: argparse.Namespace, model_dir: Path):
    """The function create_app calls in the background: load the model, build its (unstarted) engine."""
    options = offload_options(args)  # checked now, before the socket opens

    def make_engine(observer):
        from jmoe.serve.engine import ServingEngine

        model = load_for_cli(model_dir, options, backend=args.backend, compile_cache=args.compile_cache)
        return ServingEngine(model, max_batch=args.max_batch, max_queue=args.max_queue, context=args.context,
                             observer=observer, prefix_reuse=args.prefix_reuse,
                             prefill_chunk=args.prefill_chunk)
    return make_engine


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM / SIGINT: new requests get 503 while those in flight finish, then
    the process exits with status 0 (uvicorn's own handler would re-raise the signal at the end)."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame):
        self.state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for the requests in flight
        self.should_exit = True


def serve(args: argparse.Namespace) -> int:
    from jmoe.serve.http import create_app

    model_dir = resolve_model_dir(args.model)
    app = create_app(make_engine_factory(args, model_dir), args.served_model_name or model_dir.resolve().name,
                     args.api_key, args.strict_fields, compile_behind=not args.compile_all_first)
    state = app.state.server
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_config=None), state)
    # A model that fails to load stops the server; the error is reported below (exit status 2 for a JmoeError).
    state.loaded.add_done_callback(lambda f: f.exception() is not None and setattr(server, "should_exit", True))
    server.run()
    if state.loaded.done() and state.loaded.exception() is not None:
        raise state.loaded.exception()
    return 0


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines for /health and /ready: load balancers and clients poll them every second."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and len(record.args) > 2 and record.args[2] in PROBE_PATHS)


PROBE_PATHS = ("/health", "/ready")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    return run_cli(lambda: serve(args))


if __name__ == "__main__":
    sys.exit(main())
