"""A sweep of request rates against one server started here: the runs `tidal plan calibrate --serve` fits
the server's costs on, and benchmarks/serve_sweep.py prints (for Tidal and, side by side, vLLM).

A sweep is one server (`tidal serve`, or any OpenAI-compatible server's command line) on a free local
port, waited for on /health; then `tidal bench serve` (random token-id prompts of fixed lengths, greedy,
ignore_eos, Poisson arrivals): first a warm-up of SWEEP_WARMUP requests all at once, drawn with
SWEEP_WARMUP_SEED, then each rate in order, run i drawing its prompts and arrivals with sweep_seed(i), so
that no run finds an earlier run's prompts in the prefix cache. The server is stopped at the end, and on
any error or interrupt (`serving`). The planner simulates exactly these runs (calibrate.simulate_sweep).

    from tidal.benchmarks import sweep
    port = sweep.free_port()
    with sweep.serving(sweep.tidal_serve_command(model, port, 2048), port) as server:
        results = sweep.sweep(server.url, [0.5, 6.0], num_prompts=16, input_len=128, output_len=64)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

SWEEP_WARMUP = 4            # the warm-up: 4 requests, all at once ...
SWEEP_WARMUP_SEED = 10_000  # ... drawn with a seed of their own


class SweepError(RuntimeError):
    """The server did not start, or a run failed (the message says which, with the server's log)."""


def sweep_seed(index: int) -> int:
    """The seed of the sweep's run number `index` (its requests and arrivals): each run draws its own
    prompts, so none is found in the prefix cache from an earlier run."""
    return 1 + index


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tidal_serve_command(model: str, port: int, max_model_len: int = 2048, *extra: str,
                        dtype: str = "bfloat16") -> list[str]:
    """`tidal serve` on `model` at 127.0.0.1:port, as the sweep measures it: bf16 (or dtype), the given
    max_model_len, request logging off; the engine's defaults otherwise (extra: more options)."""
    return [sys.executable, "-m", "tidal.entrypoints.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--disable-log-requests", *extra]


@dataclass
class Server:
    """A server process started by `start`, in a session of its own (its process group: the server and
    whatever it starts, such as Tidal's engine core process)."""
    proc: subprocess.Popen
    url: str
    log_path: str
    name: str = "tidal"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server (Tidal's lets requests in flight finish, stops its engine core and exits),
        SIGKILL to its process group if it has not exited after `timeout` s; then whatever of the group
        outlived it is killed too."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait()
        for _ in range(50):  # up to 5 s for the rest of the group to follow the server out
            if not _group_alive(self.proc.pid):
                return
            time.sleep(0.1)  # polling the group's exit
        _kill_group(self.proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def start(cmd: Sequence[str], port: int, name: str = "tidal", env: dict | None = None,
          ready_timeout: float = 600.0, log_dir: str | None = None) -> Server:
    """Start the server command (listening on 127.0.0.1:port; its output to a log file, kept, in `log_dir`
    or the temporary folder) and wait until
    its /health answers 200. Raises SweepError (the server stopped) if it exits or is not ready within
    `ready_timeout` s; on any interrupt the server is stopped too."""
    with tempfile.NamedTemporaryFile(prefix=f"{name}-serve-", suffix=".log", dir=log_dir, delete=False) as log:
        proc = subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log.name, name)
    try:
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SweepError(f"{name} server exited with status {proc.returncode} before it was ready "
                                   f"(log {log.name}):\n{server.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            time.sleep(0.5)  # polling the server's readiness
        raise SweepError(f"{name} server was not ready after {ready_timeout:g} s (log {log.name}):\n"
                           f"{server.log_tail()}")
    except BaseException:
        server.stop()
        raise


@contextlib.contextmanager
def serving(cmd: Sequence[str], port: int, name: str = "tidal", env: dict | None = None,
            ready_timeout: float = 600.0, log_dir: str | None = None) -> Iterator[Server]:
    """`start` the server; stop it when the block ends, however it ends (an error, KeyboardInterrupt)."""
    server = start(cmd, port, name, env, ready_timeout, log_dir)
    try:
        yield server
    finally:
        server.stop()


def run_rate(url: str, rate: float, *, num_prompts: int, input_len: int, output_len: int, seed: int,
             vocab_size: int | None = None, stream: bool = True) -> dict:
    """One `tidal bench serve` run against the server at `url` (run here, in this process: its options
    parsed by its own parser, so every default is the command's): `num_prompts` random prompts of
    `input_len` token ids (below `vocab_size` when given), `output_len` out, arriving at `rate` req/s
    (Poisson; inf: all at once), requests and arrivals drawn with `seed`. Returns its results (the JSON
    `--output-json` writes; with `vocab_size` when given, so the same requests can be drawn again).
    stream=False sends them with `--no-stream` (one reply each: no TTFT, TPOT or ITL).
    Raises SweepError if the server cannot be reached or a request fails."""
    from tidal.benchmarks import serve
    argv = ["--base-url", url, "--dataset", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--seed", str(seed)]
    if vocab_size is not None:
        argv += ["--vocab-size", str(vocab_size)]
    if not stream:
        argv.append("--no-stream")
    args = serve.add_arguments(argparse.ArgumentParser(prog="tidal bench serve")).parse_args(argv)
    try:
        result = asyncio.run(serve.run(args, serve.build_requests(args)))
    except SystemExit as e:  # bench serve's own refusals (the server's model list, its probe request)
        raise SweepError(str(e)) from None
    if result["failed"]:
        raise SweepError(f"tidal bench serve at {rate:g} req/s: {result['failed']} of {num_prompts} requests "
                           f"failed: {result.get('errors')}")
    if vocab_size is not None:
        result["vocab_size"] = vocab_size
    return result


def _process_name(proc) -> str:
    """A short name of a process: its command line, the program's path cut to its last part."""
    argv = proc.cmdline() or [proc.name()]
    return " ".join([os.path.basename(argv[0]), *argv[1:]]).strip()[:60]


@contextlib.contextmanager
def cpu_split(server_pid: int) -> Iterator[dict[str, float]]:
    """The CPU seconds (user + system) used inside the block by each process of the server's tree (the
    server and every process below it when the block starts, as `pid N: <command line>`) and by this one
    (`client`: `tidal bench serve` runs here), into the dict it yields, filled when the block ends: where a
    served run's CPU time went (on 2 cores, what the server and the client take the engine's threads do
    not get). A process gone by then is left out."""
    import psutil
    try:
        root = psutil.Process(server_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = []
    before = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            before[proc] = (t.user + t.system, _process_name(proc))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    split: dict[str, float] = {}
    yield split
    after = resource.getrusage(resource.RUSAGE_SELF)
    for proc, (seconds, name) in before.items():
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            split[f"pid {proc.pid}: {name}"] = round(t.user + t.system - seconds, 2)
    split["client"] = round(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, 2)


def sweep(url: str, rates: Sequence[float], *, num_prompts: int, input_len: int, output_len: int,
          vocab_size: int | None = None, progress: Callable[[str], None] | None = None,
          cpu_of: int | None = None, stream: bool = True) -> list[dict]:
    """The sweep's runs against one server: the warm-up (not returned), then each rate in order, run i
    with sweep_seed(i). Returns each rate's `tidal bench serve` results; `progress` gets a line as each run
    starts and ends. With `cpu_of` (the server's process id) each result also holds `cpu_seconds`, the
    run's cpu_split. stream=False: the runs (not the warm-up) without streaming (run_rate)."""
    say = progress or (lambda line: None)
    lens = dict(input_len=input_len, output_len=output_len, vocab_size=vocab_size)
    t0 = time.perf_counter()
    say(f"warm-up: {SWEEP_WARMUP} requests at once")
    run_rate(url, float("inf"), num_prompts=SWEEP_WARMUP, seed=SWEEP_WARMUP_SEED, **lens)
    say(f"warm-up done in {time.perf_counter() - t0:.1f} s")
    results = []
    for i, rate in enumerate(rates):
        say(f"rate {rate:g} req/s ({i + 1} of {len(rates)}): {num_prompts} requests of {input_len} tokens, "
            f"{output_len} out, seed {sweep_seed(i)}")
        with cpu_split(cpu_of) if cpu_of is not None else contextlib.nullcontext() as cpu:
            r = run_rate(url, rate, num_prompts=num_prompts, seed=sweep_seed(i), stream=stream, **lens)
        if cpu is not None:
            r["cpu_seconds"] = cpu
        latency = (f"mean TTFT {r['mean_ttft_ms']:.1f} ms, mean TPOT {r['mean_tpot_ms']:.2f} ms" if stream
                   else f"mean E2E {r['mean_e2el_ms']:.1f} ms (not streamed)")
        say(f"rate {rate:g} req/s done in {r['duration']:.1f} s: {r['output_throughput']:.1f} output tok/s, {latency}")
        results.append(r)
    return results
