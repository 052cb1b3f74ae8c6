"""`tidal`: the command line. Each subcommand lives in its own module and registers itself here.

    tidal generate "prompt"          stream a completion to the terminal
    tidal chat                       interactive multi-turn chat on the model's chat template
    tidal serve [MODEL]              OpenAI-compatible server
    tidal bench throughput|serve     benchmarks
    tidal plan                       capacity planner (the scheduler in simulated time)
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tidal.engine import core_launch

# subcommand -> module with `register(subparsers)`; each module adds its parser and sets `func`
SUBCOMMANDS = [
    "tidal.entrypoints.cli_generate",   # generate, chat
    "tidal.entrypoints.openai.cli",     # serve
    "tidal.benchmarks.cli",             # bench throughput | serve
    "tidal.planner.cli",                # plan, plan calibrate
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="Tidal: LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `tidal serve`: its engine-core process starts now, importing while this process imports and parses
    core_process = core_launch.start_core_process() if core_launch.wants_core_process(argv) else None
    try:
        args = build_parser().parse_args(argv)
    except BaseException:
        core_launch.stop_unused(core_process)
        raise
    if core_process is not None:
        if getattr(args, "engine_core_process", False):
            args.core_process = core_process
        else:
            core_launch.stop_unused(core_process)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
