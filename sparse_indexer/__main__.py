"""Command line: ``python -m sparse_indexer {demo,check,plan,bench}``.

- ``demo``: a simulated serving loop on DeepSeek-V3.2 shapes, checked in float64 (CPU reference by default).
- ``check``: a self-check of every backend available on a device against the reference (run it first on new
  hardware); exit status 1 on any mismatch.
- ``plan``: the buffer plan for engine limits, beside what vLLM's rules reserve for the same limits.
- ``bench``: the GPU benchmark of every op and backend against the hardware floors (``--device`` auto: the GPU
  when one is visible, else the CPU; ``--smoke``: a quick run); ``bench --host``: host time per eager call of
  every op and step (``sparse_indexer/commands/bench_host.py``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .commands.cli import run_command
from .commands.plan import add_arguments as _plan_args  # the plan subcommand and its printing
from .commands.plan import run as _plan
from .commands.plan import vllm_reservations  # noqa: F401 - re-exported

MiB = 2**20


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (``main`` parses with it; tests inspect its options)."""
    parser = argparse.ArgumentParser(prog="python -m sparse_indexer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    from .commands import check, demo

    demo.add_arguments(sub.add_parser("demo", help="simulated serving loop, checked in float64",
                                      description=demo.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    check.add_arguments(sub.add_parser("check", help="self-check: every backend on a device against the reference",
                                       description=check.__doc__,
                                       formatter_class=argparse.RawDescriptionHelpFormatter))
    from .commands import plan

    _plan_args(sub.add_parser("plan", help="buffer plan for engine limits vs vLLM's reservations",
                              description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    try:
        from .commands import bench
    except ImportError as e:  # pragma: no cover - bench is optional at import time
        bench = None
        bench_err = e
    bp = sub.add_parser("bench", help="GPU benchmark of every op and backend (--smoke: a quick run, also on the CPU)",
                        description=bench.__doc__ if bench is not None else None,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    if bench is not None:
        bench.add_arguments(bp)
    else:
        bp.set_defaults(bench_err=bench_err)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from .commands import check, demo

    if args.cmd in ("demo", "check"):  # an unavailable device or backend: one line, exit 2, before any work
        return run_command(demo.run if args.cmd == "demo" else check.run, args)
    if args.cmd == "plan":
        return _plan(args)
    if getattr(args, "bench_err", None) is not None:
        print(f"error: bench is unavailable: {args.bench_err}", file=sys.stderr)
        return 2
    from .commands import bench

    return bench.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
