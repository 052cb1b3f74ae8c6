"""The live dashboard of `tidal serve`: a page at /dashboard fed by server-sent events.

    GET /dashboard                  the page (static HTML/JS/CSS shipped in the package; no data in it)
    GET /dashboard/static/<file>    its script and style sheet
    GET /dashboard/auth             {"api_key_required": bool}: whether the page must ask for the key
    GET /dashboard/token            a token for the event stream (needs the API key, as every route)
    GET /dashboard/snapshot         one snapshot as JSON (engine state, metric totals, recent points, the
                                    batch of each step numbered above `?since=`)
    GET /dashboard/events           text/event-stream: `hello` (config and history) once, then `state`
                                    every `interval` seconds (default 0.25) and `point` once a second

With --api-key, the data routes take the key as `Authorization: Bearer <key>` or a token from
/dashboard/token as `?token=` (a browser's EventSource cannot send headers; a token in an access log
opens only the dashboard, never the API).

The engine's state is read on the engine thread between two steps (AsyncLLM.call_in_engine), only
while someone watches, and once per interval however many watch; the time series come from the
Prometheus registry (tidal/metrics_history.py). With nobody watching, a step costs what it did, plus
one tuple appended to a bounded ring (EngineStats.step_history: the batch of each step).

The batch of every step: each reading asks the engine for the steps numbered above the last one it got
(engine_snapshot's `since`; only those cross from an engine-core process) and keeps them in a ring of the
same size here; each event stream remembers the last step it sent and sends the newer ones with its next
`state` (all those kept, on its first), so a page sees each step once, whatever its interval.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import secrets
import time
from collections import OrderedDict, deque
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tidal.engine.snapshot import engine_config, engine_snapshot
from tidal.engine.stats import STEP_HISTORY, steps_after
from tidal.entrypoints.openai.serving_base import error_body
from tidal.metrics import ServerMetrics
from tidal.metrics_history import MetricsHistory, read_totals

logger = logging.getLogger("tidal.entrypoints.openai")

_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_OPEN_PATHS = {"/dashboard", "/dashboard/", "/dashboard/auth", "/dashboard/events", "/dashboard/snapshot"}
_MAX_TOKENS = 256
SNAPSHOT_TIMEOUT_S = 10.0  # a step longer than this: the stream skips a beat rather than wait


def checks_own_key(path: str) -> bool:
    """Paths the API-key middleware lets through: the page itself (no data), and the data routes that
    take the key or a dashboard token themselves."""
    return path in _OPEN_PATHS or path.startswith("/dashboard/static/")


def _asset(name: str) -> bytes:
    return resources.files("tidal.entrypoints.openai").joinpath("dashboard_static", name).read_bytes()


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class Dashboard:
    def __init__(self, async_llm, metrics: ServerMetrics | None, api_key: str | None) -> None:
        self.async_llm = async_llm
        self.metrics = metrics
        self.history = MetricsHistory(metrics.registry) if metrics is not None else None
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._tokens: OrderedDict[str, float] = OrderedDict()
        self._sampler: asyncio.Task | None = None
        self._snapshot: tuple[float, dict] | None = None  # (monotonic time, snapshot), shared by all watchers
        self._pending: asyncio.Future | None = None
        self._config: dict | None = None
        self._steps: deque[list] = deque(maxlen=STEP_HISTORY)  # [num, time, prefill, decode, requests]
        self._last_step = 0  # the number of the newest step read from the engine

    # -- access ----------------------------------------------------------------------------------
    def issue_token(self) -> str | None:
        if self._expected is None:
            return None
        token = secrets.token_urlsafe(24)
        self._tokens[token] = time.time()
        while len(self._tokens) > _MAX_TOKENS:
            self._tokens.popitem(last=False)
        return token

    def allowed(self, request: Request) -> bool:
        if self._expected is None:
            return True
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, self._expected):
            return True
        token = request.query_params.get("token", "")
        return any(hmac.compare_digest(token, t) for t in self._tokens)

    # -- data ------------------------------------------------------------------------------------
    def start_sampler(self) -> None:
        if self.history is not None and (self._sampler is None or self._sampler.done()):
            self._sampler = asyncio.ensure_future(self._sample_forever())

    def stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.history.sample()
            except Exception:  # noqa: BLE001 - the dashboard must never take the server down
                logger.exception("dashboard: sampling the metrics failed")
            await asyncio.sleep(self.history.interval_s)

    async def config(self) -> dict:
        if self._config is None:
            self._config = await self.async_llm.call_in_engine(engine_config)
        return self._config

    async def snapshot(self, max_age_s: float) -> dict:
        """The engine's state, taken at most max_age_s ago; concurrent watchers share one reading."""
        if self._snapshot is not None and time.monotonic() - self._snapshot[0] <= max_age_s:
            return self._snapshot[1]
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._read_snapshot())
        pending = self._pending
        try:
            return await asyncio.shield(pending)
        finally:
            if self._pending is pending and pending.done():
                self._pending = None

    async def _read_snapshot(self) -> dict:
        read = functools.partial(engine_snapshot, since=self._last_step)  # pickles: crosses to a core process
        snap = await asyncio.wait_for(self.async_llm.call_in_engine(read), SNAPSHOT_TIMEOUT_S)
        steps = snap["steps"]
        if steps:
            self._steps.extend(steps)
            self._last_step = steps[-1][0]
        # the counters right after it: the hook that updates them ran before this call, between the same steps
        if self.metrics is not None:
            totals = read_totals(self.metrics.registry)
            totals.pop("buckets")
            snap["totals"] = totals
        self._snapshot = (time.monotonic(), snap)
        return snap

    def steps_since(self, since: int) -> list[list]:
        """The steps read so far numbered above `since` (at most the last STEP_HISTORY), oldest first."""
        return steps_after(self._steps, since)

    def points_since(self, t: float) -> list[dict]:
        return [p for p in self.history.points if p["time"] > t] if self.history is not None else []

    async def events(self, interval_s: float):
        self.start_sampler()
        last_point = 0.0
        last_step = 0  # the newest step this stream sent
        try:
            hello = {"config": await self.config(), "history": self.points_since(0.0)}
            if hello["history"]:
                last_point = hello["history"][-1]["time"]
            yield _sse("hello", hello)
            while True:
                try:
                    state = await self.snapshot(interval_s / 2)
                except asyncio.TimeoutError:
                    state = None  # a long step: try again next beat
                if state is not None:
                    steps = self.steps_since(last_step)
                    if steps:
                        last_step = steps[-1][0]
                    yield _sse("state", {**state, "steps": steps})
                for point in self.points_since(last_point):
                    last_point = point["time"]
                    yield _sse("point", point)
                await asyncio.sleep(interval_s)
        except Exception as e:  # noqa: BLE001 - e.g. the engine died: tell the page, end the stream
            yield _sse("engine_error", {"message": repr(e)})


def add_dashboard_routes(app: FastAPI, async_llm, metrics: ServerMetrics | None, api_key: str | None) -> Dashboard:
    dashboard = Dashboard(async_llm, metrics, api_key)
    app.state.dashboard = dashboard

    inner_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_):  # the history starts with the server, not when the page is first opened
        dashboard.start_sampler()
        try:
            async with inner_lifespan(app_) as state:
                yield state
        finally:
            dashboard.stop_sampler()

    app.router.lifespan_context = lifespan

    def unauthorized() -> JSONResponse:
        return JSONResponse(error_body(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
                                       "a token from /dashboard/token as ?token=", None, "invalid_api_key"),
                            status_code=401)

    @app.get("/dashboard", include_in_schema=False)
    @app.get("/dashboard/", include_in_schema=False)
    async def page():
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in _STATIC:
            return JSONResponse(error_body(404, f"no dashboard file {name!r}"), status_code=404)
        return Response(_asset(name), media_type=f"{_STATIC[name]}; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/auth", include_in_schema=False)
    async def auth():
        return {"api_key_required": api_key is not None and api_key != ""}

    @app.get("/dashboard/token", include_in_schema=False)
    async def token():  # behind the API-key middleware like every route
        return {"token": dashboard.issue_token()}

    @app.get("/dashboard/snapshot", include_in_schema=False)
    async def snapshot(request: Request, since: int = 0):
        if not dashboard.allowed(request):
            return unauthorized()
        dashboard.start_sampler()
        return {"config": await dashboard.config(), **(await dashboard.snapshot(0.0)),
                "steps": dashboard.steps_since(since), "history": dashboard.points_since(0.0)}

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request, interval: float = 0.25):
        if not dashboard.allowed(request):
            return unauthorized()
        interval = min(max(interval, 0.1), 5.0)
        return StreamingResponse(dashboard.events(interval), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return dashboard
