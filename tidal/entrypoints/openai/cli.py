"""`tidal serve [MODEL]`: the OpenAI-compatible server.

    tidal serve                                     # the default model on http://127.0.0.1:8000
    tidal serve ./my-llama --port 9000 --max-model-len 4096 --api-key secret

Every engine flag of the CLI is accepted (see `tidal serve --help`), plus the server's own:
--host, --port, --api-key (or TIDAL_API_KEY), --max-log-len, --disable-log-requests,
--uvicorn-log-level, --stats-log-interval, --chat-template, --enable-auto-tool-choice, --tool-call-parser,
--max-request-body-bytes, --max-logprobs, --allowed-origins, --trust-request-chat-template,
--max-waiting-requests, --shutdown-timeout, --engine-core-process (--no-engine-core-process).

The engine core (scheduler, model, detokenization) runs in a process of its own, talking to this one over
ZeroMQ (tidal/engine/core_process.py); --no-engine-core-process runs it on a thread of this process.

SIGTERM or SIGINT stops the server gracefully: it stops accepting, lets in-flight requests finish for
up to --shutdown-timeout seconds, aborts the rest with an error, stops the workers and exits 0 (a
second signal stops it at once). If the engine dies (its core process or a worker killed, a fault it cannot
recover from), /health and new requests answer 503 and the process exits with status 1, for a supervisor to
restart it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tidal.entrypoints.openai.input_guard import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    parse_allowed_origins,
)
from tidal.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("tidal.entrypoints.openai")


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory (HF format) or .gguf file; default: SmolLM2-135M-Instruct")
    add_engine_args(parser)  # includes --served-model-name and --disable-log-stats
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("TIDAL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $TIDAL_API_KEY, unset: no key)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of prompt and token ids shown in request logs, which show them at DEBUG "
                        "only (default: all)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request (at INFO: its id and sizes, never its prompt or output)")
    g.add_argument("--stats-log-interval", type=float, default=10.0,
                   help="seconds between periodic stats log lines (default 10; none with --disable-log-stats)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in chat requests (Jinja code from the client, run on the server; "
                        "default: refused with 400)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's text when tool_choice is \"auto\"")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="refuse a request body larger than this with 413, before reading it whole "
                        f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES} = {DEFAULT_MAX_REQUEST_BODY_BYTES >> 20} MiB; "
                        "0: no limit)")
    g.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                   help="the most logprobs, top_logprobs or prompt_logprobs a request may ask for "
                        f"(default {DEFAULT_MAX_LOGPROBS}, at most 20)")
    g.add_argument("--allowed-origins", default=None,
                   help="origins allowed to call the server from a browser (CORS), as a JSON list or "
                        "comma-separated, e.g. 'https://app.example.com'; '*' for any (default: none, CORS off)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 with Retry-After when this many requests already wait for admission "
                        "(default: no limit, every request queues)")
    g.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are "
                        "aborted (default 5)")
    g.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (scheduling, the model, detokenization) in a process of its own, "
                        "talking to the server process over ZeroMQ, so that HTTP and JSON never share its "
                        "interpreter (docs/architecture.md; default: on; --no-engine-core-process: one process)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of uvicorn (access logs at info)")
    return parser


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible server",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    parser.set_defaults(func=run_server)


def _validate(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"tidal serve: --port must be in [0, 65535], got {args.port}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise SystemExit(f"tidal serve: --max-log-len must be >= 0, got {args.max_log_len}")
    if args.stats_log_interval <= 0:
        raise SystemExit(f"tidal serve: --stats-log-interval must be > 0, got {args.stats_log_interval}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit(f"tidal serve: --max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if not args.shutdown_timeout >= 0:
        raise SystemExit(f"tidal serve: --shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("tidal serve: --enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    if args.max_request_body_bytes < 0:
        raise SystemExit(f"tidal serve: --max-request-body-bytes must be >= 0 (0: no limit), "
                         f"got {args.max_request_body_bytes}")
    if not 0 <= args.max_logprobs <= 20:
        raise SystemExit(f"tidal serve: --max-logprobs must be in [0, 20] (Tidal returns at most 20 logprobs "
                         f"per token), got {args.max_logprobs}")
    if args.allowed_origins is not None:
        try:
            args.allowed_origins = parse_allowed_origins(args.allowed_origins)
        except ValueError as e:
            raise SystemExit(f"tidal serve: {e}") from e
    if args.chat_template is not None and os.path.isfile(args.chat_template):
        with open(args.chat_template) as f:
            args.chat_template = f.read()


def run_server(args: argparse.Namespace) -> int:
    from tidal.engine.core_launch import start_core_process, stop_unused

    # the core process (started by `tidal`'s main before its imports, else here) imports while this one works
    process = getattr(args, "core_process", None)
    try:
        _validate(args)
        import uvicorn

        from tidal.engine.async_llm import AsyncLLM
        from tidal.engine.llm_engine import LLMEngine
        from tidal.entrypoints.openai.api_server import build_app
        from tidal.metrics import ServerMetrics

        if args.engine_core_process and process is None:
            process = start_core_process()
        config = engine_config_from_args(args, args.model, server=True)
        if args.engine_core_process:
            async_llm = AsyncLLM.from_config(config, max_waiting_requests=args.max_waiting_requests,
                                             core_process=True, stats_log_interval=args.stats_log_interval,
                                             process=process)
            engine = async_llm.engine  # the server process's view of it
        else:
            engine = LLMEngine(config)
    except BaseException as e:
        stop_unused(process)  # (one that took its config is stopped by CoreProcessAsyncLLM on a failure)
        if isinstance(e, ValueError):  # a bad model path or flag: say so in one line, not a traceback
            raise SystemExit(f"tidal serve: {e}") from e
        raise
    name = args.served_model_name or engine.model_name
    if engine.stats_logger is not None:  # None under --disable-log-stats
        engine.stats_logger.interval_s = args.stats_log_interval
    metrics = ServerMetrics(name)
    if args.engine_core_process:
        async_llm.step_hook = metrics
    else:
        async_llm = AsyncLLM(engine, step_hook=metrics, max_waiting_requests=args.max_waiting_requests)
    app = build_app(async_llm, name, api_key=args.api_key, metrics=metrics, max_log_len=args.max_log_len,
                    log_requests=not args.disable_log_requests, chat_template=args.chat_template,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    max_logprobs=args.max_logprobs, max_request_body_bytes=args.max_request_body_bytes or None,
                    allowed_origins=args.allowed_origins,
                    trust_request_chat_template=args.trust_request_chat_template)
    plan = engine.kv_plan
    logger.info("Serving %s (model %s, %s) on http://%s:%d/v1 — max_model_len %d, KV cache %d tokens "
                "(%d blocks of %d, %.1f MiB)%s", name, config.model or engine.model_name,
                str(engine.dtype).removeprefix("torch."), args.host, args.port, engine.max_model_len,
                plan.num_tokens, plan.num_blocks, plan.block_size, plan.num_bytes / 2**20,
                ", API key required" if args.api_key else "")
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = _server_class()(uv_config, async_llm, args.shutdown_timeout)
    async_llm.on_dead = server.engine_died
    if async_llm.dead_error is not None:  # died before it could tell
        server.engine_died(async_llm.dead_error)
    try:
        server.run()
    finally:
        async_llm.shutdown()
        engine.shutdown()  # the worker processes
    if async_llm.dead_error is not None:
        logger.error("Exiting with status 1: the engine died (%r)", async_llm.dead_error)
        # the workers and their shared memory are gone: exit now rather than after the interpreter's
        # teardown (torch's, a second or more), so a supervisor restarts the server within seconds
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


def _server_class():
    """The server class, defined on first use: `tidal --help` does not import uvicorn."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with Tidal's shutdown. On SIGTERM or SIGINT: the engine drains (new requests get
        503; in-flight ones have `shutdown_timeout` seconds, then are aborted with an error) while uvicorn
        stops accepting and waits for the connections to end (its own timeout is a backstop a few seconds
        later). The signal is not re-raised afterwards (uvicorn's default, which made the exit status 143)."""

        def __init__(self, config, async_llm, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.async_llm, self.shutdown_timeout = async_llm, shutdown_timeout

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second signal: stop now
                self.force_exit = True
                return
            logger.info("Received signal %d: shutting down, in-flight requests have %g s to finish (%d open)",
                        sig, self.shutdown_timeout, self.async_llm.num_open_requests)
            # The handler runs on the event loop's thread between two bytecodes of whatever it interrupted,
            # which may be the engine client in the middle of sending a command under its lock: start the
            # drain from the loop instead, as its next callback.
            try:
                asyncio.get_running_loop().call_soon_threadsafe(self.async_llm.drain, self.shutdown_timeout)
            except RuntimeError:  # no loop running (not serving yet)
                self.async_llm.drain(self.shutdown_timeout)
            self.should_exit = True

        def engine_died(self, error: BaseException) -> None:
            logger.error("The engine died (%r): stopping the server", error)
            self.should_exit = True  # uvicorn polls it; safe to set from the engine thread

    return Server
