"""`tidal bench throughput | serve`: registers the benchmark subcommands on the `tidal` command line.

`bench serve` lives in tidal.benchmarks.serve; it is imported only when that subcommand is built,
so `bench throughput` keeps working where the serving benchmark is absent.
"""
from __future__ import annotations

import argparse
import importlib
import sys


def _run_throughput(args: argparse.Namespace) -> int:
    from tidal.benchmarks import throughput
    return throughput.main(args)


def _run_serve(args: argparse.Namespace) -> int:
    return importlib.import_module("tidal.benchmarks.serve").main(args)


def _unavailable(name: str, error: ImportError) -> int:
    print(f"error: tidal {name} is unavailable: {error}", file=sys.stderr)
    return 2


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput (offline engine), serve (a server)",
                                  description="Benchmarks.")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    from tidal.benchmarks import throughput
    p = sub.add_parser("throughput", help="offline throughput on a fixed request set (vLLM's options)",
                       description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(p)
    p.set_defaults(func=_run_throughput)

    try:
        serve = importlib.import_module("tidal.benchmarks.serve")
    except ImportError as e:
        if getattr(e, "name", None) == "tidal.benchmarks.serve":
            return  # not built yet
        # A dependency of the serving benchmark is missing: say so when it is asked for, and
        # keep every other subcommand working.
        p = sub.add_parser("serve", help=f"(unavailable: {e})", add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs="*")  # no options: any flags given are taken as plain words
        p.set_defaults(func=lambda args, error=e: _unavailable("bench serve", error))
        return
    p = sub.add_parser("serve", help="load an OpenAI-compatible server and measure latency and throughput",
                       description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_arguments(p)
    p.set_defaults(func=_run_serve)
