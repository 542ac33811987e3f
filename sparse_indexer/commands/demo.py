"""``python -m sparse_indexer demo``: a small simulated serving loop, checked step by step in float64.

Requests arrive with prompts; each engine step schedules the decode tokens of prefilled requests first
(``next_n = 2``: one token plus one speculative token, some steps accept only one) and fills the rest of the
token budget with prompt pieces (chunked prefill). One ``Buffers`` record is allocated once from the limits
and threaded through every step. The check (unless ``--no-check``): every token's top-k selection against a float64
model of its scores, from the same FP8 queries and folded weights and the same bf16 keys quantized by
``quantize_k`` (the FP8 values and scales ``write_k_cache`` stores; dequantized exactly, products and sums in
float64). A window of at most ``topk`` keys must select
exactly its positions ``0 .. n-1``; a longer one ``topk`` distinct positions, each selected score at most
``rel_tol * max|score|`` below the ``topk``-th best float64 score (1e-5 for the reference backend and on the
CPU, 1e-3 for tensor-core kernels on a GPU: near-ties at the boundary may swap). Each step's line and the last
line say how many windows were checked each way and the largest such gap measured.

``--backend triton`` on the CPU runs the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1`` is set for
this process, as ``check`` does).
"""

from __future__ import annotations

import argparse
import time

import torch

from buffers import IndexerLimits, allocate, plan

from .. import backends
from .._runtime import dispatch as _dispatch
from ..fp8 import quantize_k, quantize_q
from ..indexer import sparse_attn_indexer
from ..kcache import new_kv_cache, slots_from_block_table
from ..metadata import build_metadata
from ..testing import topk_errors
from .cli import Progress, require_backend, resolve_device, run_command, use_triton_interpreter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="reference", choices=("auto", *backends.names()),
                   help="backend of every op; auto = the best one available on the device (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--requests", type=_positive, default=3, help="number of requests (default: %(default)s)")
    p.add_argument("--context", type=_positive, default=2400,
                   help="prompt length of the longest request, in tokens (default: %(default)s)")
    p.add_argument("--decode-steps", type=_non_negative, default=4,
                   help="decode steps after the last prefill (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompts, queries and schedule (default: %(default)s)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the float64 check of every step (default: check)")


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


class _Request:
    def __init__(self, rid: int, prompt: int, keys: torch.Tensor, q: torch.Tensor, w: torch.Tensor):
        self.rid, self.prompt = rid, prompt
        self.keys, self.q, self.w = keys, q, w  # full histories: [L, D] bf16, [L, H, D] fp8, [L, H] f32
        self.done = 0  # tokens whose keys are in the cache


def _model_rows(req: _Request, positions: range, fp8_dtype) -> list[torch.Tensor]:
    """float64 scores of the windows of ``req``'s tokens at ``positions`` (causal: keys ``[0, p + 1)``)."""
    end = positions.stop
    k8, ks = quantize_k(req.keys[:end], fp8_dtype=fp8_dtype)
    kd = k8.double() * ks.double()[:, None]
    out = []
    for p in positions:
        s = (req.q[p].double() @ kd[: p + 1].T).clamp(min=0)  # [H, p + 1]
        out.append(req.w[p].double() @ s)
    return out


def _check(sel: torch.Tensor, rows: list[torch.Tensor], topk: int, rel_tol: float) -> str | None:
    """Top-k of every row against its float64 scores (:func:`sparse_indexer.testing.topk_errors`): exact for
    short windows; otherwise every selected score must be within ``rel_tol * max|score|`` of the ``topk``-th best
    (logits computed with FP8 tensor cores differ from float64 by ~1e-4 relative, which may swap near-ties at the
    boundary). ``None`` when right, else what is wrong with the first wrong row."""
    errors = topk_errors(sel, rows, rtol=rel_tol, threshold=True, limit=1)
    return errors[0] if errors else None


def _gaps(sel: torch.Tensor, rows: list[torch.Tensor], topk: int) -> tuple[int, int, float]:
    """``(short, long, worst)``: the windows of at most ``topk`` keys, the longer ones, and over the longer ones the
    largest gap between the ``topk``-th best float64 score and the lowest selected one, relative to the row's
    largest ``|score|`` (0 when every selected score is among the top ``topk``). Positions outside a window count
    as ``-inf`` (:func:`_check` reports them)."""
    lens = torch.tensor([r.numel() for r in rows])
    long_ = [i for i, n in enumerate(lens.tolist()) if n > topk]
    if not long_:
        return len(rows), 0, 0.0
    width = int(lens.max())
    x = torch.full((len(long_), width), float("-inf"), dtype=torch.float64)
    for j, i in enumerate(long_):
        x[j, : rows[i].numel()] = rows[i]
    pos = sel[long_].cpu().long()
    inside = (pos >= 0) & (pos < lens[long_][:, None])
    got = torch.where(inside, x.gather(1, pos.clamp(0, width - 1)), float("-inf")).amin(dim=1)
    kth = x.topk(topk, dim=1).values[:, -1]
    scale = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=1).clamp(min=1e-300)
    worst = float(((kth - got) / scale).clamp(min=0).nan_to_num(float("inf")).max())
    return len(rows) - len(long_), len(long_), worst


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def run(args) -> int:
    """Run the demo; raises :class:`~sparse_indexer.commands.cli.UsageError` (nothing done yet) for a device or backend
    that is not available."""
    dev = resolve_device(args.device)
    backend = None if args.backend == "auto" else args.backend
    note = use_triton_interpreter(dev) if backend == "triton" else None  # before triton is imported
    require_backend(backend, dev)
    print(f"sparse-indexer demo: backend={args.backend} ({'/'.join(_dispatch.available(dev))} available on "
          f"{dev}), {args.requests} requests, context up to {args.context}, seed {args.seed}"
          + (f"; {note}" if note else ""))
    g = torch.Generator().manual_seed(args.seed)
    h, d, topk, bs, nn = 64, 128, 2048, 64, 2
    budget = 1024
    max_len = args.context + nn * (args.decode_steps + 2)
    lim = IndexerLimits(
        max_model_len=max_len, max_num_batched_tokens=budget, max_num_seqs=max(1, args.requests), next_n=nn,
        n_heads=h, head_dim=d, topk=topk, block_size=bs, prefill_k_tokens=2 * max_len,
        max_logits_bytes=4 * 1024 * 1024,  # 4 MiB of prefill logits: long prompts split along queries
    )
    p = plan(lim)
    print("\nbuffer plan (allocated once, threaded through every step):")
    print(p)
    buf = allocate(p, dev)
    fp8 = lim.fp8_dtype
    blocks_per_req = (max_len + bs - 1) // bs
    nb = blocks_per_req * args.requests + 1
    kv = new_kv_cache(nb, bs, d, device=dev)
    block_table = torch.randperm(nb - 1, generator=g)[: blocks_per_req * args.requests].view(
        args.requests, blocks_per_req).int()
    reqs = []
    for r in range(args.requests):
        prompt = max(1, args.context - r * args.context // (2 * max(1, args.requests)))
        total = prompt + nn * (args.decode_steps + 2)
        x = torch.randn(total, d, generator=g)
        q32 = torch.randn(total, h, d, generator=g) + x[:, None, :] * 0.5  # queries correlated with keys
        q8, qs = quantize_q(q32, fp8_dtype=fp8)
        w = torch.randn(total, h, generator=g) * (h ** -0.5) * (d ** -0.5) * qs
        reqs.append(_Request(r, prompt, x.to(torch.bfloat16), q8, w.float()))
    topk_out = torch.empty(budget, topk, dtype=torch.int32, device=dev)

    steps = []
    decode_left = args.decode_steps
    while True:
        active = [r for r in reqs if r.done >= r.prompt]
        pending = [r for r in reqs if r.done < r.prompt]
        if not pending and decode_left <= 0:
            break
        if not pending:
            decode_left -= 1
        sched = []  # (request, number of new tokens)
        for r in active:
            sched.append((r, 1 + int(torch.randint(0, nn, (1,), generator=g)) if nn > 1 else 1))
        room = budget - sum(n for _, n in sched)
        for r in pending:
            if room <= nn:
                break
            n = min(r.prompt - r.done, room)
            if n <= nn:  # a prompt tail this short would be taken for a decode: leave it for the next step
                n = min(r.prompt - r.done, nn + 1)
                if n <= nn or n > room:
                    continue
            sched.append((r, n))
            room -= n
        steps.append(sched)
        for r, n in sched:
            r.done += n
    for r in reqs:
        r.done = 0
    print(f"\n{len(steps)} steps scheduled (token budget {budget}, next_n {nn}); running:")

    failures = 0
    times = []
    progress = Progress(len(steps))  # drawn only on a terminal
    # the reference accumulates exact FP8 products in float32 (~1e-7 relative); tensor-core kernels ~1e-4
    rel_tol = 1e-5 if args.backend == "reference" or dev.type == "cpu" else 1e-3
    if not args.no_check:
        print(f"each step's top-{topk} of every token is checked against a float64 model of its scores (the same "
              "FP8 queries and weights, the keys\nquantized by quantize_k as write_k_cache stores them, in float64): "
              f"a window of <= {topk} keys must select exactly its positions 0..n-1 ('exact'),\na longer one {topk} "
              f"distinct positions whose lowest selected score is at most {rel_tol:.0e} x max|score| below the "
              f"{topk}th best ('gap')")
    totals = [0, 0, 0.0]  # windows checked exactly, longer windows, the largest gap
    for i, sched in enumerate(steps):
        seq = [r.done + n for r, n in sched]
        qry = [n for _, n in sched]
        bt = block_table[[r.rid for r, _ in sched]]
        pos = [torch.arange(r.done, r.done + n) for r, n in sched]
        slots = torch.cat([slots_from_block_table(bt[j : j + 1], pos[j][None, :], bs)[0] for j in range(len(pos))])
        md = build_metadata(seq, qry, bt, slots, lim, device=dev, num_blocks=nb)
        q = torch.cat([r.q[r.done : r.done + n] for r, n in sched]).to(dev)
        k = torch.cat([r.keys[r.done : r.done + n] for r, n in sched]).to(dev)
        w = torch.cat([r.w[r.done : r.done + n] for r, n in sched]).to(dev)
        kind = f"{md.num_decodes} decode ({md.num_decode_tokens} tok) + {md.num_prefills} prefill " \
               f"({md.num_prefill_tokens} tok, {_plural(len(md.prefill_chunks), 'chunk')})"
        progress.update(i, kind)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sparse_attn_indexer(q, k, w, kv, md, buf, topk_out, backend=backend)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        verdict = "unchecked"
        if not args.no_check:
            rows = []
            for r, n in sched:
                rows += _model_rows(r, range(r.done, r.done + n), fp8)
            sel = topk_out[: md.num_tokens]
            err = _check(sel, rows, topk, rel_tol)
            short, long_, worst = _gaps(sel, rows, topk)
            totals = [totals[0] + short, totals[1] + long_, max(totals[2], worst)]
            measured = f"{short} exact, {long_} by gap" + (f" (worst {worst:.1e})" if long_ else "")
            verdict = f"ok: {measured}" if err is None else f"MISMATCH ({measured}): {err}"
            failures += err is not None
        for r, n in sched:
            r.done += n
        progress.clear()
        print(f"  step {i + 1:2d}/{len(steps)}: {kind:<48} {dt * 1e3:8.1f} ms  {verdict}")
    progress.update(len(steps), "done")
    progress.clear()
    total = sum(times)
    print(f"\n{len(steps)} steps, {sum(len(s) for s in steps)} request-steps, indexer time {total * 1e3:.1f} ms "
          f"(mean {total / max(1, len(steps)) * 1e3:.1f} ms/step); "
          + ("float64 check skipped" if args.no_check else
             f"float64 check: {len(steps) - failures}/{len(steps)} steps ok"))
    if not args.no_check:
        print(f"top-{topk} of {totals[0] + totals[1]} tokens against float64 scores: {totals[0]} windows of <= {topk} "
              f"keys selected exactly;\n{totals[1]} longer windows, largest gap below the {topk}th best score "
              f"{totals[2]:.1e} x max|score| (tolerance {rel_tol:.0e})")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparse_indexer demo")
    add_arguments(p)
    return run_command(run, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

