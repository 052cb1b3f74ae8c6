"""Starting the engine-core process (tidal/engine/core_process.py) without importing the engine: `tidal serve`
starts it before its own imports (tidal/entrypoints/cli.py), so that the two processes' imports (torch,
transformers' config machinery: ~3 s each on a 2-core Zen 3) run at once. The process imports the engine,
then waits for CoreProcessAsyncLLM to send it the config (give it as `process`; kill it if none comes)."""
from __future__ import annotations

import subprocess
import sys


def start_core_process() -> subprocess.Popen:
    # a plain `python -m` child (not multiprocessing's spawn, which re-runs the parent's main script)
    return subprocess.Popen([sys.executable, "-m", "tidal.engine.core_process"], stdin=subprocess.PIPE)


def wants_core_process(argv: list[str]) -> bool:
    """Whether the command line `argv` (without the program name) runs `tidal serve` with its engine in a
    core process (the default): then the process can start before the arguments are parsed."""
    return (bool(argv) and argv[0] == "serve" and "--no-engine-core-process" not in argv
            and not {"-h", "--help"} & set(argv))


def stop_unused(process: subprocess.Popen | None) -> None:
    """Stop a core process that no config will reach (still waiting for one)."""
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()
