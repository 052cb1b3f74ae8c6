"""The live dashboard (/dashboard): its engine snapshot, the batch of each step and the metric history on
their own, then a real `tidal serve` (the default model, with an API key) over plain HTTP, then the page
itself in a real headless Chromium driven by Selenium."""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import threading
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import running_server
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.scheduler import Scheduler
from tidal.engine.snapshot import engine_snapshot
from tidal.engine.stats import STEP_HISTORY, EngineStats
from tidal.metrics import ServerMetrics
from tidal.metrics_history import MetricsHistory, histogram_quantile
from tidal.request import Request
from tidal.sampling_params import SamplingParams

API_KEY = "dashboard-key"
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT = 240  # seconds; loading the model on a busy 2-core machine


# -- the engine snapshot and the metric history, without a server ---------------------------------

class _Engine:
    """What engine_snapshot reads of an LLMEngine: the real scheduler and KV manager."""

    def __init__(self, num_blocks: int = 8, block_size: int = 4) -> None:
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_caching=True)
        self.scheduler = Scheduler(self.kv_manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
        self.stats = EngineStats()


def _admit(engine: _Engine, request_id: str, prompt: list[int]) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=4))
    engine.scheduler.add_request(request)
    engine.scheduler.schedule()
    return request


def test_snapshot_block_map_counts_owners_and_shared_blocks():
    engine = _Engine()
    _admit(engine, "a", list(range(9)))  # 3 blocks of 4
    snap = engine_snapshot(engine)
    kv = snap["kv"]
    assert [r["id"] for r in snap["requests"]] == ["a"] and snap["requests"][0]["status"] == "running"
    owned = [i for i, o in enumerate(kv["owner"]) if o == 0]
    assert owned == engine.kv_manager.get_block_ids("a")
    assert kv["cells"].count("u") == 3 and (kv["free"], kv["in_use"]) == (5, 3)
    assert kv["free"] + kv["cached"] + kv["in_use"] == kv["num_blocks"] == 8
    # a second request with the same first 8 tokens shares a's two full blocks (a prefix-cache hit)
    _admit(engine, "b", list(range(8)) + [99])
    kv = engine_snapshot(engine)["kv"]
    assert kv["cells"].count("s") == 2 and kv["shared"] == 2
    c = engine.kv_manager.pool.counts()
    assert (kv["free"], kv["cached"], kv["in_use"]) == (c.free, c.cached, c.in_use)


def test_snapshot_shows_finished_requests_blocks_as_cached():
    engine = _Engine()
    from tidal.request import RequestStatus
    _admit(engine, "a", list(range(9)))
    engine.scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    snap = engine_snapshot(engine)
    assert snap["requests"] == [] and snap["kv"]["in_use"] == 0
    assert snap["kv"]["cached"] == 2 and snap["kv"]["cells"].count("c") == 2  # the two full blocks stay cached


def test_snapshot_shows_mamba_state_slots_and_their_owners():
    from tidal.core.state_pool import StatePool
    engine = _Engine()
    engine.scheduler = Scheduler(engine.kv_manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                 state_pool=StatePool(3))
    request = _admit(engine, "a", list(range(5)))
    state = engine_snapshot(engine)["state"]
    assert state["num_slots"] == 3 and state["free"] == 2
    assert state["owner"][request.state_slot] == 0 and state["owner"].count(-2) == 2  # -2: a free slot
    assert engine_snapshot(_Engine())["state"] is None  # no Mamba layers, no slots


def test_snapshot_groups_blocks_of_a_large_pool():
    engine = _Engine(num_blocks=100)
    _admit(engine, "a", list(range(9)))
    kv = engine_snapshot(engine, max_cells=10)["kv"]
    assert kv["blocks_per_cell"] == 10 and len(kv["cells"]) == len(kv["owner"]) == 10
    assert kv["cells"][0] == "u" and kv["owner"][0] == 0 and set(kv["cells"][1:]) == {"f"}


# -- the batch of each step ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    """A real LLMEngine on a tiny random llama: a step budget of 16 tokens, so a longer prompt is chunked."""
    from tests.helpers import tiny_llm
    return tiny_llm(tiny_model_dir(), max_model_len=128, block_size=4, max_num_batched_tokens=16).llm_engine


def _add(engine, request_id: str, num_prompt: int, max_tokens: int) -> None:
    prompt = [3 + (7 * i + 31 * sum(map(ord, request_id))) % 400 for i in range(num_prompt)]  # no shared prefix
    engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _batches(steps) -> list[tuple[int, int, int]]:
    return [(prefill, decode, n) for _, _, prefill, decode, n in steps]


def test_snapshot_lists_the_batch_of_every_step_since_the_last_one(tiny_engine):
    engine = tiny_engine
    start, prompt_tokens = engine.stats.num_steps, engine.stats.num_prompt_tokens
    assert engine_snapshot(engine, since=start)["steps"] == []
    _add(engine, "a", 10, 4)
    engine.step()  # a's prompt
    _add(engine, "b", 20, 2)
    while engine.has_unfinished_requests():
        engine.step()
    snap = engine_snapshot(engine, since=start)
    steps = snap["steps"]
    # every step, in order: a prompt step counts its prompt tokens as prefill, a decode step one token per
    # running request; b's 20-token prompt is chunked into the 16-token budget beside a's decodes
    assert [s[0] for s in steps] == list(range(start + 1, engine.stats.num_steps + 1))
    assert _batches(steps) == [(10, 0, 1), (15, 1, 2), (5, 1, 2), (0, 2, 2)]
    assert sum(s[2] for s in steps) == engine.stats.num_prompt_tokens - prompt_tokens == 30
    assert snap["step"] == {"num": steps[-1][0], "prefill_tokens": 0, "decode_tokens": 2, "num_requests": 2}
    assert all(snap["time"] - 60 < s[1] <= snap["time"] + 1e-3 for s in steps)  # the time each step ended
    assert [s[1] for s in steps] == sorted(s[1] for s in steps)
    # `since`: only the newer steps; none once caught up
    assert engine_snapshot(engine, since=steps[2][0])["steps"] == steps[3:]
    assert engine_snapshot(engine, since=steps[-1][0])["steps"] == []


def _fake_batch(prefill: int, decode: int) -> SimpleNamespace:
    """What record_step reads of a batch: one request computing `prefill` prompt tokens, and `decode`
    requests decoding one token each."""
    scheduled = [SimpleNamespace(num_tokens=prefill, num_prompt_tokens=prefill, start_pos=0)] if prefill else []
    scheduled += [SimpleNamespace(num_tokens=1, num_prompt_tokens=5, start_pos=9)] * decode
    return SimpleNamespace(scheduled=scheduled, num_batched_tokens=prefill + decode)


def test_step_history_is_a_bounded_ring_that_stays_in_the_engine_process():
    from tidal.engine.core_process import _DECODER, _ENCODER, CoreMessage
    engine = _Engine()
    stats = engine.stats
    assert stats.steps_since(0) == [] and stats.step_history is None
    for i in range(STEP_HISTORY + 10):
        stats.record_step(_fake_batch(i % 7, i % 3), i % 3, engine.scheduler, engine.kv_manager)
    steps = stats.steps_since(0)
    assert len(stats.step_history) == len(steps) == STEP_HISTORY  # bounded: the oldest ten are gone
    assert [s[0] for s in steps] == list(range(11, STEP_HISTORY + 11))
    assert all((s[2], s[3], s[4]) == ((s[0] - 1) % 7, (s[0] - 1) % 3, bool((s[0] - 1) % 7) + (s[0] - 1) % 3)
               for s in steps)
    assert stats.steps_since(STEP_HISTORY + 7) == steps[-3:] and stats.steps_since(10**9) == []
    # the stats go to the server process after every step (msgspec): the ring does not travel with them
    data = _ENCODER.encode(CoreMessage("step", stats=stats))
    assert len(data) < 1000
    copy = _DECODER.decode(data).stats
    assert copy.num_steps == stats.num_steps and copy.step_history is None and copy.steps_since(0) == []


class _InlineLLM:
    """call_in_engine as a core process runs it: the function and its answer pickled across, the engine
    read between two steps (here: between the test's own engine.step() calls)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def call_in_engine(self, fn):
        return pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(fn))(self.engine)))


def _parse(event: str) -> tuple[str, dict]:
    head, data = event.strip().split("\n")
    return head.removeprefix("event: "), json.loads(data.removeprefix("data: "))


def test_each_event_stream_sends_every_step_once(tiny_engine):
    from tidal.entrypoints.openai.dashboard import Dashboard
    engine = tiny_engine

    def run(n: int) -> list[int]:
        _add(engine, f"r{engine.stats.num_steps}", 3, n)
        while engine.has_unfinished_requests():
            engine.step()
        return list(range(engine.stats.num_steps - n + 1, engine.stats.num_steps + 1))

    async def main():
        dashboard = Dashboard(_InlineLLM(engine), None, None)
        a, b = dashboard.events(0.1), dashboard.events(0.1)
        assert _parse(await anext(a))[0] == "hello"
        kind, first = _parse(await anext(a))
        assert kind == "state" and first["steps"] == [list(s) for s in engine_snapshot(engine)["steps"]]
        seen_a = [s[0] for s in first["steps"]]
        new1 = run(3)  # a prompt step and two decodes
        kind, state = _parse(await anext(a))
        assert [s[0] for s in state["steps"]] == new1 and _batches(state["steps"]) == [(3, 0, 1), (0, 1, 1), (0, 1, 1)]
        seen_a += new1
        assert _parse(await anext(b))[0] == "hello"  # a second page opens: it gets all the steps kept
        assert [s[0] for s in _parse(await anext(b))[1]["steps"]] == seen_a[-STEP_HISTORY:]
        new2 = run(2)
        for stream in (a, b):  # both see the newer steps, once
            assert [s[0] for s in _parse(await anext(stream))[1]["steps"]] == new2
        for stream in (a, b):
            assert _parse(await anext(stream))[1]["steps"] == []  # nothing new
        await a.aclose()
        await b.aclose()
        assert dashboard.steps_since(new2[0]) == [list(s) for s in engine_snapshot(engine, since=new2[0])["steps"]]

    asyncio.run(main())


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 8.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 2.0)]) == 1.0  # in +Inf: the highest bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_metrics_history_rates_and_latency_percentiles():
    metrics = ServerMetrics(MODEL)
    history = MetricsHistory(metrics.registry, rate_window_s=2.0, latency_window_s=2.0)
    history.sample(now=100.0)
    metrics.generation_tokens.inc(50)
    metrics.prefix_queries.inc(40)
    metrics.prefix_hits.inc(10)
    for v in (0.03, 0.03, 0.07, 0.07):
        metrics.ttft.observe(v)
    history.sample(now=101.0)
    p = history.sample(now=102.0)
    assert p["generation_tps"] == pytest.approx(25.0) and p["prompt_tps"] == 0
    assert p["prefix_hit_rate"] == pytest.approx(0.25)
    assert p["ttft_p50"] == pytest.approx(0.04) and 0.06 < p["ttft_p99"] <= 0.08
    assert p["tpot_p50"] is None and p["spec_acceptance"] is None


# -- a real server over HTTP ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--kv-cache-memory-bytes", "67108864", "--max-model-len", "2048", "--api-key", API_KEY,
            "--max-num-seqs", "2", "--disable-log-requests", "--uvicorn-log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("dashboard") / "server.log", STARTUP_TIMEOUT) as (_, base):
        yield base


def _auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def _metrics(server: str) -> dict:
    """Each sample of /metrics, summed over its labels (e.g. request_success_total over finish reasons)."""
    text = httpx.get(f"{server}/metrics", headers=_auth()).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL and "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _complete(server: str, prompt: str, max_tokens: int) -> None:
    r = httpx.post(f"{server}/v1/completions", headers=_auth(), timeout=300,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text


def _events(lines, count: int) -> list[tuple[str, dict]]:
    """The first `count` server-sent events of a stream of lines."""
    out, event = [], None
    for line in lines:
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((event, json.loads(line[len("data: "):])))
            if len(out) == count:
                return out
    return out


def test_page_and_assets_are_served_without_the_key(server):
    page = httpx.get(f"{server}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/static/dashboard.js" in page.text and "http" not in page.text.replace("http-equiv", "")
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        r = httpx.get(f"{server}/dashboard/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert httpx.get(f"{server}/dashboard/static/..%2Fapi_server.py").status_code == 404  # only its own files
    assert httpx.get(f"{server}/dashboard/auth").json() == {"api_key_required": True}


def test_dashboard_data_needs_the_key_or_a_token(server):
    assert httpx.get(f"{server}/dashboard/snapshot").status_code == 401
    assert httpx.get(f"{server}/dashboard/events").status_code == 401
    assert httpx.get(f"{server}/dashboard/snapshot", params={"token": "guess"}).status_code == 401
    assert httpx.get(f"{server}/dashboard/token").status_code == 401  # a token needs the key itself
    assert httpx.get(f"{server}/dashboard/snapshot", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server}/dashboard/snapshot", headers=_auth()).status_code == 200
    token = httpx.get(f"{server}/dashboard/token", headers=_auth()).json()["token"]
    assert httpx.get(f"{server}/dashboard/snapshot", params={"token": token}).status_code == 200
    assert httpx.get(f"{server}/v1/models", params={"token": token}).status_code == 401  # the dashboard only


def test_snapshot_totals_agree_with_metrics(server):
    _complete(server, "The capital of France is", 8)
    snap = httpx.get(f"{server}/dashboard/snapshot", headers=_auth()).json()
    metrics = _metrics(server)
    totals = snap["totals"]
    assert totals["generation_tokens"] == metrics["tidal:generation_tokens_total"] >= 8
    assert totals["prompt_tokens"] == metrics["tidal:prompt_tokens_total"] > 0
    assert totals["prefix_queries"] == metrics["tidal:prefix_cache_queries_total"]
    assert totals["requests_finished"] == metrics["tidal:request_success_total"] >= 1
    assert snap["config"]["model"] == MODEL and snap["num_running"] == 0 and snap["requests"] == []
    kv = snap["kv"]
    assert kv["in_use"] == 0 and kv["free"] + kv["cached"] == kv["num_blocks"] == snap["config"]["num_blocks"]
    assert snap["step"]["num"] > 0 and snap["history"], "the history sampler runs from startup"


def test_snapshot_follows_a_running_request_and_its_blocks(server):
    worker = threading.Thread(target=_complete, args=(server, "Once upon a time", 400))
    worker.start()
    try:
        seen = []
        while len(seen) < 2 and worker.is_alive():  # two snapshots that show it running, its output growing
            snap = httpx.get(f"{server}/dashboard/snapshot", headers=_auth()).json()
            running = [r for r in snap["requests"] if r["status"] == "running" and r["output_tokens"] > 0]
            if running and (not seen or running[0]["output_tokens"] > seen[-1]["output_tokens"]):
                seen.append(running[0])
                assert snap["kv"]["owner"].count(0) == running[0]["blocks"] > 0
                assert running[0]["prompt_computed"] == running[0]["prompt_tokens"]
        assert len(seen) == 2, "the request finished before two snapshots saw it"
    finally:
        worker.join()


def test_event_stream_sends_hello_then_states(server):
    token = httpx.get(f"{server}/dashboard/token", headers=_auth()).json()["token"]
    with httpx.stream("GET", f"{server}/dashboard/events", params={"token": token, "interval": 0.1},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines(), 4)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "hello" and events[0][1]["config"]["model"] == MODEL
    states = [data for kind, data in events if kind == "state"]
    assert len(states) >= 2 and all("kv" in s and "totals" in s for s in states)


def test_event_stream_shows_each_step_of_a_request_once(server):
    """Through the engine-core process: the state events list every step of a request, once each, with
    its batch (one prompt step, then one decode token a step), and /dashboard/snapshot?since= the newer."""
    before = _metrics(server)
    max_tokens = 12
    token = httpx.get(f"{server}/dashboard/token", headers=_auth()).json()["token"]
    with httpx.stream("GET", f"{server}/dashboard/events", params={"token": token, "interval": 0.1},
                      timeout=120) as r:
        lines = r.iter_lines()
        hello, first = _events(lines, 2)
        assert hello[0] == "hello" and first[0] == "state"
        start = first[1]["step"]["num"]
        assert [s[0] for s in first[1]["steps"]][-1:] == ([start] if start else [])  # the steps kept so far
        worker = threading.Thread(target=_complete, args=(server, "Each step of this request, once", max_tokens))
        worker.start()
        steps, last = [], None
        try:
            while last is None or not steps or steps[-1][0] < last:
                got = _events(lines, 1)
                assert got, "the event stream ended"
                kind, data = got[0]
                if kind == "state":
                    steps += data["steps"]
                if last is None and not worker.is_alive():  # the request is done: the engine's last step
                    last = httpx.get(f"{server}/dashboard/snapshot", headers=_auth()).json()["step"]["num"]
        finally:
            worker.join()
    after = _metrics(server)
    nums = [s[0] for s in steps]
    assert nums == list(range(start + 1, start + 1 + len(steps))), "a step missing or sent twice"
    prompt_tokens = after["tidal:prompt_tokens_total"] - before["tidal:prompt_tokens_total"]
    assert prompt_tokens > 0 and _batches(steps) == [(prompt_tokens, 0, 1)] + [(0, 1, 1)] * (max_tokens - 1)
    snap = httpx.get(f"{server}/dashboard/snapshot", headers=_auth(), params={"since": nums[-3]}).json()
    assert [s[0] for s in snap["steps"]] == nums[-2:] and snap["step"]["num"] == nums[-1]


# -- the page in a real browser -------------------------------------------------------------------

def _chromium():
    pytest.importorskip("selenium")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1250"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def browser():
    driver = _chromium()
    yield driver
    driver.quit()


def test_page_shows_the_engine_live_and_agrees_with_metrics(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def text(element_id: str) -> str:
        return browser.find_element(By.ID, element_id).text

    def number(element_id: str) -> float:
        return float(text(element_id).replace(",", "").rstrip("%") or "nan")

    wait = WebDriverWait(browser, 120, poll_frequency=0.1)
    browser.get(f"{server}/dashboard")
    wait.until(lambda d: d.find_element(By.ID, "api-key").is_displayed())  # the key is asked for, once
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "login-button").click()
    wait.until(lambda d: text("model") == MODEL)
    wait.until(lambda d: text("stat-generation-tokens") not in ("", "–"))
    before = number("stat-generation-tokens")

    # six requests on two running slots: some wait, the map fills with their blocks
    prompts = [f"Request {i}: write a long story about the sea. " * (4 + 3 * i) for i in range(6)]
    workers = [threading.Thread(target=_complete, args=(server, p, 96)) for p in prompts]
    for w in workers:
        w.start()
    try:
        wait.until(lambda d: number("stat-running") > 0 and number("stat-waiting") > 0)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tbody tr")) >= 2)
        wait.until(lambda d: number("kv-in-use") > 0 and number("stat-generation-tokens") > before + 20)
        screenshot = os.environ.get("TIDAL_DASHBOARD_SCREENSHOT", str(tmp_path / "dashboard.png"))
        assert browser.save_screenshot(screenshot)
    finally:
        for w in workers:
            w.join()

    # once idle, the page's numbers are /metrics' numbers
    def agrees(_) -> bool:
        m = _metrics(server)
        return (number("stat-generation-tokens") == m["tidal:generation_tokens_total"]
                and number("stat-prompt-tokens") == m["tidal:prompt_tokens_total"]
                and number("stat-preemptions") == m["tidal:num_preemptions_total"]
                and number("stat-running") == m["tidal:num_requests_running"] == 0
                and number("kv-in-use") == 0)
    wait.until(agrees)
    assert number("stat-generation-tokens") >= before + 6 * 96
    assert number("kv-free") + number("kv-cached") == browser.execute_script("return config.num_blocks")
    # the step chart holds a bar for each of the latest steps: none missing, the newest the engine's last
    nums, newest = browser.execute_script("return [steps.map((s) => s[0]), lastState.step.num]")
    assert len(nums) == browser.execute_script("return MAX_STEPS") and nums[-1] == newest
    assert nums == list(range(nums[0], newest + 1))
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


# -- a hybrid engine in process, without an API key -----------------------------------------------

def test_hybrid_engine_snapshot_through_the_app_without_a_key(tmp_path):
    """A tiny random Jamba: the snapshot shows each running request's Mamba state slot, and the data
    routes need no key when the server has none."""
    import asyncio

    from tests.test_hybrid import save_tiny_hybrid
    from tidal import LLM
    from tidal.engine.async_llm import AsyncLLM
    from tidal.entrypoints.openai.api_server import build_app

    save_tiny_hybrid("jamba", str(tmp_path))
    engine = LLM(str(tmp_path), dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=64,
                 kv_cache_memory_bytes=4 << 20).llm_engine
    for i in range(2):
        # different prompts: a prompt identical to one still computing waits for its state checkpoint
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(3 + i, 40 + i))}, SamplingParams(max_tokens=50))
    engine.step()  # both admitted (the second one in part), each with its slot
    engine.has_unfinished_requests = lambda: False  # the engine thread then only serves calls: no step moves them
    async_llm = AsyncLLM(engine, step_hook=ServerMetrics("jamba"))
    app = build_app(async_llm, "jamba", metrics=async_llm.step_hook)

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            return await client.get(path)

    try:
        assert asyncio.run(get("/dashboard/auth")).json() == {"api_key_required": False}
        assert asyncio.run(get("/dashboard/token")).json() == {"token": None}
        snap = asyncio.run(get("/dashboard/snapshot")).json()
    finally:
        async_llm.shutdown()
    stream = asyncio.run(get("/dashboard/events")).text  # a stopped engine ends the stream, saying why
    assert stream.startswith("event: hello") and "event: engine_error" in stream and "shutting down" in stream
    assert snap["config"]["num_state_slots"] == snap["state"]["num_slots"] > 0
    held = {r["state_slot"]: i for i, r in enumerate(snap["requests"]) if r["status"] == "running"}
    assert len(held) == 2 and all(snap["state"]["owner"][slot] == i for slot, i in held.items())
    assert snap["state"]["free"] == snap["state"]["num_slots"] - len(held)
