"""Command line: ``python -m sparse_indexer {demo,check,plan,bench}``.

- ``demo``: a simulated serving loop on DeepSeek-V3.2 shapes, checked in float64 (CPU reference by default).
- ``check``: a self-check of every backend available on a device against the reference (run it first on new
  hardware); exit status 1 on any mismatch.
- ``plan``: the buffer plan for engine limits, beside what vLLM's rules reserve for the same limits.
- ``bench``: the GPU benchmark of every op and backend against the hardware floors.
"""

from __future__ import annotations

import argparse
import sys

import torch

from buffers import IndexerLimits, plan

from ._cli import UsageError

MiB = 2**20


def vllm_reservations(lim: IndexerLimits) -> list[tuple[str, int]]:
    """What vLLM's rules reserve for the same limits: the prefill gather of ``max_model_len * 40`` tokens of
    ``D + 4`` bytes, the decode logits ``max_num_seqs * next_n * max_model_len`` float32, the 512 MiB cap of
    prefill logits."""
    gather = lim.max_model_len * 40 * (lim.head_dim + 4)
    decode = lim.max_num_seqs * lim.next_n * lim.max_model_len * 4
    prefill_logits = 512 * MiB
    return [
        ("prefill K gather (max_model_len*40 tokens x (D+4) B)", gather),
        ("decode logits (max_num_seqs*next_n*max_model_len x 4 B)", decode),
        ("prefill logits cap", prefill_logits),
        ("total (all reserved separately)", gather + decode + prefill_logits),
    ]


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", type=int, default=163840)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--next-n", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prefill-k-tokens", type=int, default=None, help="default max_model_len * 40")
    p.add_argument("--max-logits-mib", type=int, default=512)
    p.add_argument("--with-qk", action="store_true", help="also plan the per-head qk buffer (aiter stage1)")


def _plan(args) -> int:
    kw = dict(
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, next_n=args.next_n, n_heads=args.heads, head_dim=args.head_dim,
        topk=args.topk, block_size=args.block_size, max_logits_bytes=args.max_logits_mib * MiB,
        with_qk=args.with_qk,
    )
    if args.prefill_k_tokens is not None:
        kw["prefill_k_tokens"] = args.prefill_k_tokens
    lim = IndexerLimits(**kw)
    p = plan(lim)
    print(f"limits: {lim}\n")
    print("sparse-indexer plan (one arena, fields reused between prefill chunks and decode):")
    print(p)
    print("\nvLLM's rules for the same limits:")
    rows = vllm_reservations(lim)
    w = max(len(n) for n, _ in rows)
    for name, b in rows:
        print(f"  {name:<{w}}  {b:>14,d} B  {b / MiB:>10.1f} MiB")
    ours = p.total_bytes
    theirs = rows[-1][1]
    print(f"\nplan total {ours / MiB:.1f} MiB vs vLLM {theirs / MiB:.1f} MiB "
          f"({(theirs - ours) / MiB:+.1f} MiB saved, {ours / theirs:.2f}x)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (``main`` parses with it; tests inspect its options)."""
    parser = argparse.ArgumentParser(prog="python -m sparse_indexer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    from . import check, demo

    demo.add_arguments(sub.add_parser("demo", help="simulated serving loop, checked in float64",
                                      description=demo.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    check.add_arguments(sub.add_parser("check", help="self-check: every backend on a device against the reference",
                                       description=check.__doc__,
                                       formatter_class=argparse.RawDescriptionHelpFormatter))
    _plan_args(sub.add_parser("plan", help="buffer plan for engine limits vs vLLM's reservations"))
    try:
        from . import bench
    except ImportError as e:  # pragma: no cover - bench is optional at import time
        bench = None
        bench_err = e
    bp = sub.add_parser("bench", help="GPU benchmark of every op and backend")
    if bench is not None:
        bench.add_arguments(bp)
    else:
        bp.set_defaults(bench_err=bench_err)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from . import check, demo

    try:
        if args.cmd == "demo":
            return demo.run(args)
        if args.cmd == "check":
            return check.run(args)
    except UsageError as e:  # an unavailable device or backend: one line, before any work
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "plan":
        return _plan(args)
    if getattr(args, "bench_err", None) is not None:
        print(f"error: bench is unavailable: {args.bench_err}", file=sys.stderr)
        return 2
    from . import bench

    return bench.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
