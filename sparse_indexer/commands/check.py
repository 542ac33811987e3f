"""``python -m sparse_indexer check``: a self-check of every backend on this machine against the reference.

Run it first on new hardware (an AMD GPU, a new NVIDIA part, a new Triton or torch): it draws fresh random inputs
(the seed is printed, ``--seed`` repeats a run), runs each op with every backend available on the device, and
compares the result with the reference backend on the CPU (exact FP8 emulation, docs/spec.md §2) on the same
inputs:

- ``write_k_cache`` and ``gather_k_cache``: byte for byte (plain scales may differ by one FP8 step where the
  quotient lies within ``2**-20`` of a midpoint, docs/spec.md §3);
- ``fp8_mqa_logits`` and ``fp8_paged_mqa_logits``: relative L2 error inside the windows, ``-inf`` masks exactly
  (1-D and 2-D context lengths, ``next_n`` 1 to 4, ``clean`` on and off);
- ``top_k_per_row``: docs/spec.md §6 on the same logits (short rows exact, long rows by the multiset of selected
  values; with and without the split-row workspace; ties, ``-inf`` and NaN);
- ``fp8_mqa_topk`` and ``fp8_paged_mqa_topk`` (§6b): the selection exact on the scores the op returned and those
  within the logits tolerance of the reference's (float32 and bfloat16 scores, the prefill rows in blocks of a
  smaller scratch, the decode op without logits judged on the reference's scores);
- ``step``: mixed steps of ``sparse_attn_indexer`` end to end (packed and uniform decode, prefill chunks split
  along queries, padding rows; DeepSeek-V4's compressed cache of one key per 4 tokens with ``topk`` 512 and
  1024), the cache bytes against the reference and every selected key's float64 score against the true top-k.

Every FP8 format the backend supports on the device is checked. One table row per case gives the measured
error and the tolerance; the exit status is 0 when every case passes, 1 on any mismatch or error, 2 when the
device or backend is not available (nothing is run). On the CPU the Triton backend runs under Triton's
interpreter (``TRITON_INTERPRET=1`` is set for this process when triton is not imported yet).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from buffers import CacheFormat, IndexerLimits, allocate

from .. import backends
from .._runtime import dispatch as _dispatch
from ..fp8 import fp8_name, quantize_k, quantize_q
from ..indexer import sparse_attn_indexer
from ..kcache import cache_views, compressed_slot_mapping, new_kv_cache, slots_from_block_table
from ..metadata import build_metadata
from ..mxfp4 import dequantize_mxfp4, quantize_k_mxfp4, quantize_q_mxfp4
from ..ops.fp8_mqa_logits import fp8_mqa_logits
from ..ops.fp8_mqa_topk import fp8_mqa_topk
from ..ops.fp8_paged_mqa_logits import fp8_paged_mqa_logits, row_limits
from ..ops.fp8_paged_mqa_topk import fp8_paged_mqa_topk
from ..ops.gather_k_cache import gather_k_cache
from ..ops.select_candidate_blocks import select_candidate_blocks
from ..ops.top_k_per_row import top_k_per_row
from ..ops.top_k_per_row.workspace import COUNTERS as TOPK_SCRATCH_COUNTERS
from ..ops.top_k_per_row.workspace import topk_scratch_cap
from ..ops.write_k_cache import write_k_cache
from ..testing import (
    FUSED_LOGITS_RTOL_L2_BF16,
    candidate_errors,
    candidate_topk_errors,
    fused_topk_errors,
    logits_error,
    topk_errors,
)
from .cli import UsageError, require_backend, resolve_device, run_command, use_triton_interpreter
from .fuzz import default_jobs, run_fuzz

__all__ = ["CHECKS", "add_arguments", "run", "main"]

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run: small enough for Triton's CPU interpreter, or GPU-sized."""

    write_tokens: int
    gather_lens: tuple[int, ...]
    ragged_seq: tuple[int, ...]
    ragged_query: tuple[int, ...]
    paged_ctx: tuple[int, ...]  # context lengths of the decode requests (one 0: a padding request)
    topk_width: int
    topk_rows: int
    step_ctx: int  # longest context of a step
    step_topk: int


SMALL = Sizes(write_tokens=300, gather_lens=(333, 0, 1, 129), ragged_seq=(300, 181), ragged_query=(40, 23),
              paged_ctx=(517, 0, 70), topk_width=2600, topk_rows=6, step_ctx=700, step_topk=256)
FULL = Sizes(write_tokens=4096, gather_lens=(8192, 0, 1, 3001, 16384), ragged_seq=(8192, 3001),
             ragged_query=(1024, 333), paged_ctx=(16384, 0, 4097, 70, 8191, 12000, 1, 2049), topk_width=65536,
             topk_rows=16, step_ctx=20000, step_topk=2048)


@dataclass
class Case:
    """One row of the table."""

    op: str
    name: str
    error: str
    tolerance: str
    status: str  # "ok", "MISMATCH", "ERROR", "n/a"


class Ctx:
    """What every case needs: backend under test, device, FP8 format, sizes and a seeded generator."""

    def __init__(self, backend: str, device: torch.device, fp8: torch.dtype, sizes: Sizes, seed: int):
        self.backend, self.device, self.fp8, self.sizes, self.seed = backend, device, fp8, sizes, seed

    @property
    def op_backend(self) -> str | None:
        """What the ops get: ``None`` for ``"auto"`` (the best backend per op, as an engine runs them)."""
        return None if self.backend == "auto" else self.backend

    def gen(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1000003 + salt) % 2**63)

    @property
    def logits_rtol(self) -> float:
        """Relative L2 tolerance of logits: exact float32 emulation (the reference, or any backend on the CPU)
        agrees to ~1e-7; FP8 tensor cores accumulate differently (~1e-4, tests/gpu)."""
        return 1e-5 if self.backend == "reference" or self.device.type == "cpu" else 1e-3

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# --------------------------------------------------------------------------------------------- formats
def formats(backend: str, device: torch.device) -> tuple[list[torch.dtype], str | None]:
    """FP8 formats ``backend`` is checked with on ``device`` (those the hardware has), and why the other one is
    left out (or ``None``). The reference is only checked on a GPU (on the CPU it is the baseline)."""
    if device.type == "cpu":
        return [FN], "e4m3fnuz: not checked (Triton's CPU interpreter has no float8_e4m3fnuz)"
    from ..ops._aiter import NATIVE_FP8, gcn_arch

    arch = gcn_arch(device)
    if arch is None:
        return [FN], "e4m3fnuz: not checked (an AMD-only format)"
    native = NATIVE_FP8.get(arch, FN)
    other = FNUZ if native == FN else FN
    return [native], f"{fp8_name(other)}: not checked ({arch} kernels use {fp8_name(native)})"


def _shuffled(ctx: Ctx, block_size: int) -> bool:
    """Whether the backend under test keeps this cache preshuffled (aiter on gfx942/gfx950, docs/spec.md §4)."""
    if ctx.backend not in ("aiter", "auto") or "aiter" not in _dispatch.available(ctx.device):
        return False
    from ..ops._aiter import gcn_arch, preshuffled

    return preshuffled(block_size, ctx.fp8, gcn_arch(ctx.device))


def _slot_contents(kv: torch.Tensor, fp8: torch.dtype, shuffled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's value bytes ``[nb * bs, D]`` uint8 and scale ``[nb * bs]`` float32 of a CPU cache."""
    values, scales = cache_views(kv, fp8)
    nb, bs, d = values.shape
    if shuffled:
        from ..ops._aiter import preshuffle_offsets, raw_blocks

        raw, _ = raw_blocks(kv if kv.dim() == 3 else kv[:, :, 0, :])
        v = raw[:, preshuffle_offsets(bs, d)]
    else:
        v = values.view(torch.uint8)
    return v.reshape(nb * bs, d), scales.reshape(nb * bs)


# ----------------------------------------------------------------------------------------------- cases
def _keys(g: torch.Generator, t: int, d: int) -> torch.Tensor:
    """``[t, D]`` bfloat16 keys with a spread of magnitudes; row 0 is zero (its scale is the floor)."""
    k = torch.randn(t, d, generator=g) * torch.rand(t, 1, generator=g).add(0.05) * 8
    if t:
        k[0] = 0  # amax below the scale floor
    return k.to(torch.bfloat16)


def _compare_cache(ctx: Ctx, got_kv: torch.Tensor, want_kv: torch.Tensor, k: torch.Tensor, slots: torch.Tensor,
                   scale_fmt) -> tuple[str, bool]:
    """Slot contents of the cache under test against the reference's; plain scales allow the docs/spec.md §3
    midpoint difference on written slots."""
    bs = want_kv.shape[1]
    gv, gs = _slot_contents(got_kv.cpu(), ctx.fp8, _shuffled(ctx, bs))
    wv, ws = _slot_contents(want_kv, ctx.fp8, False)
    bad_scale = gs.view(torch.int32) != ws.view(torch.int32)
    bad = gv != wv
    mid = torch.zeros_like(bad)
    if scale_fmt is None and bool(bad.any()):
        keep = slots >= 0
        rows = torch.full((gv.shape[0],), -1, dtype=torch.long)
        rows[slots[keep].long()] = torch.arange(slots.shape[0])[keep]
        written = rows >= 0
        exact = torch.zeros(gv.shape, dtype=torch.float64)
        exact[written] = k[rows[written]].double() / ws[written].double()[:, None]
        a = gv.view(ctx.fp8).double()
        b = wv.view(ctx.fp8).double()
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        near = ((exact - (a + b) / 2).abs() <= 2.0**-20 * exact.abs()) & (lo <= exact) & (exact <= hi)
        mid = bad & near & written[:, None]
        bad = bad & ~mid
    nbad = int(bad.sum()) + 4 * int(bad_scale.sum())
    total = gv.numel() + 4 * gs.numel()
    text = f"{nbad} of {total} B differ"
    if int(mid.sum()):
        text += f" (+{int(mid.sum())} at midpoints)"
    return text, nbad == 0


def case_write(ctx: Ctx, d: int, bs: int, scale_fmt, pad: int, four_d: bool) -> tuple[str, str, bool]:
    g = ctx.gen(1 + d + bs + pad)
    t = ctx.sizes.write_tokens
    nb = t // bs + 3
    k = _keys(g, t, d)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[::7] = -1
    want = new_kv_cache(nb, bs, d, block_pad=pad, four_d=four_d)
    write_k_cache(k, want, slots, scale_fmt=scale_fmt, fp8_dtype=ctx.fp8, backend="reference")
    got = new_kv_cache(nb, bs, d, device=ctx.device, block_pad=pad, four_d=four_d)
    write_k_cache(k.to(ctx.device), got, slots.to(ctx.device), scale_fmt=scale_fmt, fp8_dtype=ctx.fp8,
                  backend=ctx.op_backend)
    ctx.sync()
    err, ok = _compare_cache(ctx, got, want, k, slots, scale_fmt)
    return err, "0 B" + (" (+midpoints)" if scale_fmt is None else ""), ok


def _paged_requests(ctx: Ctx, g: torch.Generator, lens, d: int, bs: int, pad: int = 0, copy: bool = False):
    """Keys of requests with context ``lens`` written into two caches (the reference's on the CPU, the backend's
    on the device) through one random block table. Returns (keys, block_table, ref cache, device cache).
    ``copy``: the device cache is a copy of the reference's bytes where the backend reads that layout (for the
    paged logits and the step, which read a cache: ``write_k_cache`` is checked byte for byte by its own rows;
    under the CPU interpreter the write of every key is most of those rows' time)."""
    max_blocks = max(1, max((n + bs - 1) // bs for n in lens))
    nb = sum((n + bs - 1) // bs for n in lens) + 3
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        nblk = (n + bs - 1) // bs
        bt[r, :nblk] = perm[used : used + nblk].int()
        used += nblk
    keys = [_keys(g, n, d) for n in lens]
    k_all = torch.cat(keys) if keys else torch.zeros(0, d, dtype=torch.bfloat16)
    slots = torch.cat([slots_from_block_table(bt[r : r + 1], torch.arange(n)[None, :], bs)[0]
                       for r, n in enumerate(lens)])
    ref = new_kv_cache(nb, bs, d, block_pad=pad)
    write_k_cache(k_all, ref, slots, fp8_dtype=ctx.fp8, backend="reference")
    kv = new_kv_cache(nb, bs, d, device=ctx.device, block_pad=pad)
    if copy and not _shuffled(ctx, bs):
        kv.copy_(ref)
        return keys, bt, ref, kv
    # the cache through the backend under test where it has the op (a logits-only backend, e.g. gluon: auto's)
    writer = ctx.op_backend if "write_k_cache" in _ops_of(ctx.backend) else None
    write_k_cache(k_all.to(ctx.device), kv, slots.to(ctx.device), fp8_dtype=ctx.fp8, backend=writer)
    return keys, bt, ref, kv


def case_gather(ctx: Ctx, d: int, bs: int, pad: int) -> tuple[str, str, bool]:
    g = ctx.gen(100 + d + bs)
    lens = ctx.sizes.gather_lens
    _, bt, ref, kv = _paged_requests(ctx, g, lens, d, bs, pad)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1]) + 5  # the 5 rows past the end must stay untouched
    want_k = torch.full((n, d), 0x55, dtype=torch.uint8).view(ctx.fp8)
    want_s = torch.full((n,), -1.0)
    gather_k_cache(ref, bt, cu, out_k=want_k, out_scale=want_s, backend="reference", cache_fp8_dtype=ctx.fp8)
    got_k = torch.full((n, d), 0x55, dtype=torch.uint8, device=ctx.device).view(ctx.fp8)
    got_s = torch.full((n,), -1.0, device=ctx.device)
    gather_k_cache(kv, bt.to(ctx.device), cu.to(ctx.device), out_k=got_k, out_scale=got_s, backend=ctx.op_backend,
                   cache_fp8_dtype=ctx.fp8)
    ctx.sync()
    bad = int((got_k.cpu().view(torch.uint8) != want_k.view(torch.uint8)).sum())
    bad += 4 * int((got_s.cpu().view(torch.int32) != want_s.view(torch.int32)).sum())
    return f"{bad} of {n * (d + 4)} B differ", "0 B", bad == 0


def _queries(g: torch.Generator, rows: int, h: int, d: int, fp8, keys: torch.Tensor | None = None):
    """FP8 queries ``[rows, H, D]`` and weights ``[rows, H]`` with the scales folded in (docs/spec.md §5);
    queries correlated with ``keys`` (``[rows, D]``) when given, so the scores have structure."""
    q = torch.randn(rows, h, d, generator=g)
    if keys is not None:
        q = q + keys.float()[:, None, :] * 0.5
    q8, qs = quantize_q(q, fp8_dtype=fp8)
    w = torch.randn(rows, h, generator=g) * h**-0.5 * d**-0.5 * qs
    return q8, w.float()


def _logits_verdict(ctx: Ctx, got: torch.Tensor, want: torch.Tensor, inside: torch.Tensor, clean: bool,
                    size: Callable[[], torch.Tensor] | None = None) -> tuple[str, str, bool]:
    """Scores ``got`` against the reference's ``want`` inside the windows. A relative L2 error above the tolerance
    is judged again relative to the magnitudes ``size()`` (the reference with ``|weights|``, made only then:
    :mod:`sparse_indexer.testing`), which can only lower it."""
    err, mask_bad = logits_error(got, want, inside, clean=clean)
    of = ""
    if err > ctx.logits_rtol and size is not None and err != float("inf"):
        err, mask_bad = logits_error(got, want, inside, clean=clean, scale=size())
        of = " of the magnitudes"
    text = f"rel L2 {err:.1e}{of}" + (f", {mask_bad} -inf cells differ" if mask_bad else "")
    return text, f"{ctx.logits_rtol:.0e}", err <= ctx.logits_rtol and mask_bad == 0


def case_ragged(ctx: Ctx, h: int, d: int, clean: bool) -> tuple[str, str, bool]:
    g = ctx.gen(200 + h + d + clean)
    seq, qry = ctx.sizes.ragged_seq, ctx.sizes.ragged_query
    keys = _keys(g, sum(seq), d)
    k8, ks = quantize_k(keys, fp8_dtype=ctx.fp8)
    starts, ends, qkeys, c = [], [], [], 0
    for s, q in zip(seq, qry):
        for j in range(q):
            starts.append(c)
            ends.append(c + s - q + j + 1)
            qkeys.append(keys[c + s - q + j])
        c += s
    q8, w = _queries(g, len(starts), h, d, ctx.fp8, torch.stack(qkeys))
    st, en = torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32)
    want = fp8_mqa_logits(q8, k8, ks, w, st, en, backend="reference")
    size = lambda: fp8_mqa_logits(q8, k8, ks, w.abs(), st, en, backend="reference")  # noqa: E731
    dev = ctx.device
    out = torch.full((len(starts), sum(seq)), float("nan"), device=dev)
    fp8_mqa_logits(q8.to(dev), k8.to(dev), ks.to(dev), w.to(dev), st.to(dev), en.to(dev), out=out, clean=clean,
                   backend=ctx.op_backend)
    ctx.sync()
    n = torch.arange(sum(seq))[None, :]
    inside = (n >= st.long()[:, None]) & (n < en.long()[:, None])
    return _logits_verdict(ctx, out, want, inside, clean, size)


def case_ragged_mxfp4(ctx: Ctx, h: int, d: int, clean: bool) -> tuple[str, str, bool]:
    """The ragged scores of MXFP4 queries and keys (docs/spec.md §3a), causal windows of two requests."""
    g = ctx.gen(250 + h + d + clean)
    n = sum(ctx.sizes.ragged_seq)
    keys = _keys(g, n, d)
    kv, ks = quantize_k_mxfp4(keys)
    m = 2 * h
    starts = torch.randint(0, max(1, n // 2), (m,), generator=g, dtype=torch.int32)
    ends = torch.randint(n // 2, n + 1, (m,), generator=g, dtype=torch.int32)
    qv, qs = quantize_q_mxfp4(torch.randn(m, h, d, generator=g) + keys[ends.long() - 1].float()[:, None, :] * 0.5)
    w = torch.randn(m, h, generator=g) * h**-0.5 * d**-0.5
    want = fp8_mqa_logits(qv, kv, ks, w, starts, ends, q_scale=qs, backend="reference")
    size = lambda: fp8_mqa_logits(qv, kv, ks, w.abs(), starts, ends, q_scale=qs, backend="reference")  # noqa: E731
    dev = ctx.device
    out = torch.full((m, n), float("nan"), device=dev)
    fp8_mqa_logits(qv.to(dev), kv.to(dev), ks.to(dev), w.to(dev), starts.to(dev), ends.to(dev), out=out,
                   clean=clean, q_scale=qs.to(dev), backend=ctx.op_backend)
    ctx.sync()
    cols = torch.arange(n)[None, :]
    inside = (cols >= starts.long()[:, None]) & (cols < ends.long()[:, None])
    return _logits_verdict(ctx, out, want, inside, clean, size)


def case_mxfp4_cache(ctx: Ctx, d: int, bs: int) -> tuple[str, str, bool]:
    """An MXFP4 cache (docs/spec.md §3a): the backend's write, gather and paged scores against the reference's
    bytes and scores (exactly: the reference is the only backend that scores a paged MXFP4 cache today)."""
    fmt = CacheFormat(values="mxfp4")
    g = ctx.gen(270 + d + bs)
    lens, nn, h = [3 * bs + 5, 1, bs], 2, 16
    nb = sum(-(-n // bs) for n in lens) + 2
    keys = _keys(g, sum(lens), d)
    slots = torch.randperm(nb * bs, generator=g)[: sum(lens)]
    dev = ctx.device
    want_kv = new_kv_cache(nb, bs, d, mxfp4=True)
    write_k_cache(keys, want_kv, slots, cache_format=fmt, backend="reference")
    got_kv = new_kv_cache(nb, bs, d, device=dev, mxfp4=True)
    write_k_cache(keys.to(dev), got_kv, slots.to(dev), cache_format=fmt, backend=ctx.op_backend)
    ctx.sync()
    if not torch.equal(got_kv.cpu(), want_kv):
        return f"{int((got_kv.cpu() != want_kv).sum())} cache bytes differ", "exact", False
    table = torch.zeros(len(lens), -(-max(lens) // bs), dtype=torch.int32)  # each request's slots, in order
    o = 0
    for r, n in enumerate(lens):
        blocks = slots[o : o + n : bs] // bs
        table[r, : len(blocks)] = blocks.int()
        o += n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out_k = torch.zeros(sum(lens), d // 2, dtype=torch.uint8, device=dev)
    out_s = torch.zeros(sum(lens), d // 32, dtype=torch.uint8, device=dev)
    want_k, want_s = torch.zeros_like(out_k, device="cpu"), torch.zeros_like(out_s, device="cpu")
    gather_k_cache(want_kv, table, cu, out_k=want_k, out_scale=want_s, cache_format=fmt, backend="reference")
    gather_k_cache(got_kv, table.to(dev), cu.to(dev), out_k=out_k, out_scale=out_s, cache_format=fmt,
                   backend=ctx.op_backend)
    ctx.sync()
    if not (torch.equal(out_k.cpu(), want_k) and torch.equal(out_s.cpu(), want_s)):
        return "gathered bytes differ", "exact", False
    qv, qs = quantize_q_mxfp4(torch.randn(len(lens) * nn, h, d, generator=g))
    qv, qs = qv.view(len(lens), nn, h, d // 2), qs.view(len(lens), nn, h, d // 32)
    w = torch.randn(len(lens) * nn, h, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32)
    want = fp8_paged_mqa_logits(qv, want_kv, w, cl, table, cache_format=fmt, q_scale=qs, backend="reference")
    got = fp8_paged_mqa_logits(qv.to(dev), got_kv, w.to(dev), cl.to(dev), table.to(dev), cache_format=fmt,
                               q_scale=qs.to(dev), backend=ctx.op_backend)
    ctx.sync()
    inside = torch.arange(want.shape[1])[None, :] < row_limits(cl, nn)[:, None]
    return _logits_verdict(ctx, got, want, inside, True)


def case_mxfp4_paged_tiled(ctx: Ctx, next_n: int) -> tuple[str, str, bool]:
    """The paged scores of an MXFP4 cache in aiter's tiled order (``tiled:32,16,2``: H = 64, D = 128, 64-entry
    pages, what vLLM's ROCm MXFP4 caches hold), written by the reference; the backend's scores against the
    reference's (aiter's own paged MXFP4 kernel on gfx950)."""
    fmt = CacheFormat.tiled_mxfp4(32)
    g = ctx.gen(290 + next_n)
    h, d, bs, lens = 64, 128, 64, [5 * 64 + 9, 1, 64, 200]
    nb = len(lens) * 6 + 2
    kv = new_kv_cache(nb, bs, d, mxfp4=True)
    write_k_cache(_keys(g, nb * bs, d), kv, torch.arange(nb * bs), cache_format=fmt, backend="reference")
    table = torch.randperm(nb, generator=g)[: len(lens) * 6].view(len(lens), 6).int()  # 6 blocks per request
    cl = torch.tensor(lens, dtype=torch.int32)
    qv, qs = quantize_q_mxfp4(torch.randn(len(lens) * next_n, h, d, generator=g))
    qv, qs = qv.view(len(lens), next_n, h, d // 2), qs.view(len(lens), next_n, h, d // 32)
    w = torch.randn(len(lens) * next_n, h, generator=g) * (h * d) ** -0.5
    want = fp8_paged_mqa_logits(qv, kv, w, cl, table, cache_format=fmt, q_scale=qs, backend="reference")
    dev = ctx.device
    got = fp8_paged_mqa_logits(qv.to(dev), kv.to(dev), w.to(dev), cl.to(dev), table.to(dev), cache_format=fmt,
                               q_scale=qs.to(dev), backend=ctx.op_backend)
    ctx.sync()
    inside = torch.arange(want.shape[1])[None, :] < row_limits(cl, next_n)[:, None]
    return _logits_verdict(ctx, got, want, inside, True)


def _paged_inputs(ctx: Ctx, g: torch.Generator, next_n: int, two_d: bool, h: int, d: int, bs: int):
    """Decode inputs of the paged cases: ``(q8 [B, next_n, H, D], weights, context_lens, block_table, the
    reference's cache, the backend's cache, row limits)`` for the requests of ``sizes.paged_ctx`` (1-D lengths,
    or with ``two_d`` per-token lengths of requests with fewer new tokens, padding slots 0)."""
    lens = [max(n, next_n) if n else 0 for n in ctx.sizes.paged_ctx]
    b = len(lens)
    keys, bt, ref, kv = _paged_requests(ctx, g, lens, d, bs, copy=True)
    if two_d:  # per-token lengths: request r has d_r <= next_n new tokens, padding slots 0
        rows = []
        for n in lens:
            dr = int(torch.randint(1, next_n + 1, (1,), generator=g)) if n else 0
            rows.append([n - dr + j + 1 if j < dr else 0 for j in range(next_n)])
        ctx_lens = torch.tensor(rows, dtype=torch.int32)
    else:
        ctx_lens = torch.tensor(lens, dtype=torch.int32)
    lim = row_limits(ctx_lens, next_n)
    qkeys = torch.stack([keys[r][max(0, int(lim[r * next_n + j]) - 1)] if lens[r] else torch.zeros(d)
                         for r in range(b) for j in range(next_n)])
    q8, w = _queries(g, b * next_n, h, d, ctx.fp8, qkeys)
    return q8.view(b, next_n, h, d), w, ctx_lens, bt, ref, kv, lim


def case_paged(ctx: Ctx, next_n: int, two_d: bool, h: int = 64, d: int = 128, bs: int = 64) -> tuple[str, str, bool]:
    g = ctx.gen(300 + next_n * 2 + two_d + h + bs)
    q8, w, ctx_lens, bt, ref, kv, lim = _paged_inputs(ctx, g, next_n, two_d, h, d, bs)
    b = q8.shape[0]
    width = bt.shape[1] * bs
    want = fp8_paged_mqa_logits(q8, ref, w, ctx_lens, bt, backend="reference", cache_fp8_dtype=ctx.fp8)
    size = lambda: fp8_paged_mqa_logits(q8, ref, w.abs(), ctx_lens, bt, backend="reference",  # noqa: E731
                                        cache_fp8_dtype=ctx.fp8)
    dev = ctx.device
    clean = not two_d
    out = torch.full((b * next_n, width), float("nan"), device=dev)
    fp8_paged_mqa_logits(q8.to(dev), kv, w.to(dev), ctx_lens.to(dev), bt.to(dev), out=out, clean=clean,
                         backend=ctx.op_backend, cache_fp8_dtype=ctx.fp8)
    ctx.sync()
    inside = torch.arange(width)[None, :] < lim[:, None]
    return _logits_verdict(ctx, out, want, inside, clean, size)


def _fused_verdict(ctx: Ctx, sel: torch.Tensor, logits, want: torch.Tensor, starts, ends,
                   size: Callable[[], torch.Tensor] | None = None) -> tuple[str, str, bool]:
    """A fused op's result (docs/spec.md §6b): with the scores it returned (``logits``), its selection exact on them
    and they within the logits tolerance of the reference's (``want``; bfloat16 scores: also one rounding; an error
    above it judged again relative to the magnitudes ``size()``, :mod:`sparse_indexer.testing`); without, its
    selection on the reference's scores within that tolerance of the ``topk``-th largest."""
    bf16 = want.dtype == torch.bfloat16
    tol = max(ctx.logits_rtol, FUSED_LOGITS_RTOL_L2_BF16) if bf16 else ctx.logits_rtol
    if logits is not None:
        errors = fused_topk_errors(sel, logits.cpu(), starts, ends, expected=want, rtol_l2=tol)
        if size is not None and any(e.startswith("logits: relative L2") for e in errors):
            errors = fused_topk_errors(sel, logits.cpu(), starts, ends, expected=want, rtol_l2=tol, scale=size())
    else:
        errors = topk_errors(sel, want, starts, ends, rtol=tol * 4 if bf16 else tol, threshold=True)
    rows = sum(e.startswith("row ") for e in errors)
    text = f"{rows} of {sel.shape[0]} rows wrong" + (", scores off" if len(errors) > rows else "")
    return text, f"{tol:.0e}, 0 rows", not errors


def case_paged_topk(ctx: Ctx, next_n: int, two_d: bool, dtype: torch.dtype, given: bool, topk: int = 256,
                    h: int = 64, d: int = 128, bs: int = 64) -> tuple[str, str, bool]:
    """``fp8_paged_mqa_topk`` against the reference's on the inputs of :func:`case_paged` (``given``: with the
    caller's logits, which the op must fill with the scores it selected on)."""
    if ctx.fp8 != FN:
        raise NotImplementedError("the fused ops read e4m3fn caches only")
    g = ctx.gen(700 + next_n * 2 + two_d + given)
    q8, w, ctx_lens, bt, ref, kv, lim = _paged_inputs(ctx, g, next_n, two_d, h, d, bs)
    rows, width = q8.shape[0] * next_n, bt.shape[1] * bs
    want_logits = torch.zeros(rows, width, dtype=dtype)
    fp8_paged_mqa_topk(q8, ref, w, ctx_lens, bt, out=torch.empty(rows, topk, dtype=torch.int32),
                       logits=want_logits, backend="reference")
    size = lambda: fp8_paged_mqa_logits(q8, ref, w.abs(), ctx_lens, bt, backend="reference")  # noqa: E731
    dev = ctx.device
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=dev)
    logits = torch.full((rows, width), float("nan"), dtype=dtype, device=dev) if given else None
    fp8_paged_mqa_topk(q8.to(dev), kv, w.to(dev), ctx_lens.to(dev), bt.to(dev), out=out, logits=logits,
                       logits_dtype=dtype, backend=ctx.op_backend)
    ctx.sync()
    return _fused_verdict(ctx, out.cpu(), logits, want_logits, torch.zeros_like(lim), lim, size)


def case_ragged_topk(ctx: Ctx, topk: int, block_rows: int | None, dtype: torch.dtype, h: int = 32,
                     d: int = 64) -> tuple[str, str, bool]:
    """``fp8_mqa_topk`` on causal windows as :func:`case_ragged`'s (``block_rows``: a scratch of that many rows (at
    most ``M``), the rows in blocks; ``None``: the whole ``[M, N]`` scratch, whose scores are then judged too)."""
    if ctx.fp8 != FN:
        raise NotImplementedError("checked in e4m3fn only")
    g = ctx.gen(800 + topk + (block_rows or 0))
    seq, qry = ctx.sizes.ragged_seq, ctx.sizes.ragged_query
    keys = _keys(g, sum(seq), d)
    k8, ks = quantize_k(keys, fp8_dtype=ctx.fp8)
    starts, ends, c = [], [], 0
    for s, q in zip(seq, qry):
        for j in range(0, q, 4):  # every 4th query (the top-k's rows are most of the interpreter's time)
            starts.append(c)
            ends.append(c + s - q + j + 1)
        c += s
    q8, w = _queries(g, len(starts), h, d, ctx.fp8, keys[torch.tensor(ends) - 1])
    st, en = torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32)
    m, n = len(starts), sum(seq)
    want_logits = torch.zeros(m, n, dtype=dtype)
    fp8_mqa_topk(q8, k8, ks, w, st, en, out=torch.empty(m, topk, dtype=torch.int32), logits=want_logits,
                 backend="reference")
    size = lambda: fp8_mqa_logits(q8, k8, ks, w.abs(), st, en, backend="reference")  # noqa: E731
    dev = ctx.device
    out = torch.full((m, topk), -7, dtype=torch.int32, device=dev)
    logits = torch.full((min(block_rows, m) if block_rows else m, n), float("nan"), dtype=dtype, device=dev)
    fp8_mqa_topk(q8.to(dev), k8.to(dev), ks.to(dev), w.to(dev), st.to(dev), en.to(dev), out=out, logits=logits,
                 backend=ctx.op_backend)
    ctx.sync()
    return _fused_verdict(ctx, out.cpu(), None if block_rows else logits, want_logits, st, en, size)


def _topk_rows_wrong(sel: torch.Tensor, logits: torch.Tensor, starts, ends) -> int:
    """Rows of ``sel`` that break docs/spec.md §6 on ``logits`` (:func:`sparse_indexer.testing.topk_errors`)."""
    return len(topk_errors(sel, logits, starts, ends))


def case_topk(ctx: Ctx, topk: int, workspace: bool, special: bool) -> tuple[str, str, bool]:
    g = ctx.gen(400 + topk + workspace + special)
    w_, r = ctx.sizes.topk_width, ctx.sizes.topk_rows
    if workspace:
        r = max(3, r // 4)  # few rows: the Triton backend splits each row over several programs
    x = torch.randn(r, w_, generator=g)
    if special:  # ties, -inf and NaN inside the windows; row 2 has fewer finite cells than topk
        x = (x * 4).round() / 4
        x[x > 2.5] = float("-inf")
        x[x == -2.75] = float("nan")
        x[2, : topk - 30] = float("-inf")
    lens = [w_, topk, topk + 1, 100, 0, w_ - topk // 2]
    starts = torch.tensor([(0 if i % 2 == 0 else 7) for i in range(r)], dtype=torch.int32)
    ln = torch.tensor([max(0, min(lens[i % len(lens)], w_ - int(starts[i]))) for i in range(r)], dtype=torch.int32)
    ends = starts + ln
    out_ref = torch.empty(r, topk, dtype=torch.int32)
    top_k_per_row(x, starts, ends, out=out_ref, backend="reference")
    ref_wrong = _topk_rows_wrong(out_ref, x, starts, ends)
    dev = ctx.device
    out = torch.full((r, topk), -7, dtype=torch.int32, device=dev)
    ws = None
    if workspace:
        cap = topk_scratch_cap(IndexerLimits(max_model_len=w_, max_num_batched_tokens=r, max_num_seqs=r, topk=topk))
        ws = torch.empty(r, TOPK_SCRATCH_COUNTERS + 2 * cap, dtype=torch.int32, device=dev)
    top_k_per_row(x.to(dev), starts.to(dev), ends.to(dev), out=out, backend=ctx.op_backend, workspace=ws)
    ctx.sync()
    wrong = _topk_rows_wrong(out.cpu(), x, starts, ends)
    text = f"{wrong} of {r} rows wrong" + (f" (reference: {ref_wrong})" if ref_wrong else "")
    return text, "0 rows", wrong == 0 and ref_wrong == 0


def _scores64(keys: torch.Tensor, q8: torch.Tensor, w: torch.Tensor, fp8) -> torch.Tensor:
    """float64 docs/spec.md §5 scores of queries ``[t, H, D]`` against quantized ``keys`` ``[L, D]``: ``[t, L]``."""
    k8, ks = quantize_k(keys, fp8_dtype=fp8)
    kd = k8.double()
    s = torch.einsum("thd,ld->thl", q8.double(), kd).clamp(min=0)
    return torch.einsum("th,thl->tl", w.double(), s) * ks.double()[None, :]


def case_step(ctx: Ctx, next_n: int, decode_lens: tuple[int, ...], prefill: tuple[tuple[int, int], ...],
              pad_rows: int, h: int = 64, d: int = 128, bs: int = 64, c: int = 1,
              topk: int | None = None, split: bool = True) -> tuple[str, str, bool]:
    """One ``sparse_attn_indexer`` step: decode requests with ``decode_lens`` new tokens (contexts between a
    quarter of ``step_ctx`` and ``step_ctx``), prefill requests ``(context in thousandths of step_ctx, new
    tokens)``, ``pad_rows`` padding tokens; the prefill logits cap splits the longest prefill along its queries
    (``split``: and the case insists that it did; the fuzz's drawn steps need not split).

    ``c > 1``: a compressed cache of one key per ``c`` tokens (DeepSeek-V4's indexer, docs/spec.md §4a): contexts
    are ``c`` times longer (``step_ctx`` keys at most, and more keys than ``topk``), a token writes a key only
    when it ends a group (``compressed_slot_mapping``), a query at position ``p`` sees ``(p + 1) // c`` keys."""
    g = ctx.gen(500 + next_n + len(decode_lens) + pad_rows + 7 * c)
    topk = topk or ctx.sizes.step_topk
    big = ctx.sizes.step_ctx if c == 1 else c * max(ctx.sizes.step_ctx, topk + topk // 4)
    dec_ctx = [int(torch.randint(big // 4, big, (1,), generator=g)) for _ in decode_lens]
    qry = list(decode_lens) + [q for _, q in prefill]
    seq = [max(s, q) for s, q in zip(dec_ctx + [x * big // 1000 for x, _ in prefill], qry)]
    n_tok = sum(qry)
    t = n_tok + pad_rows
    old = [(s - q) // c for s, q in zip(seq, qry)]  # keys of groups that ended before this step
    keys, bt, ref, kv = _paged_requests(ctx, g, old, d, bs, copy=True)
    # the block table must also cover this step's keys: append fresh blocks after the cache's last one
    max_blocks = max(1, max((s // c + bs - 1) // bs for s in seq))
    nb_old = ref.shape[0]
    bt_full = torch.zeros(len(seq), max_blocks, dtype=torch.int32)
    nxt = nb_old
    for r, s in enumerate(seq):
        have, need = (old[r] + bs - 1) // bs, (s // c + bs - 1) // bs
        bt_full[r, :have] = bt[r, :have]
        bt_full[r, have:need] = torch.arange(nxt, nxt + need - have, dtype=torch.int32)
        nxt += need - have
    nb = nxt
    ref_full = new_kv_cache(nb, bs, d)
    ref_full[:nb_old] = ref
    kv_full = new_kv_cache(nb, bs, d, device=ctx.device)
    kv_full[:nb_old] = kv
    # this step's keys, and a row of k per token (the key of the group it ends; zeros for the others, whose slot
    # is -1); queries correlated with their row of k, weights; decode rows first
    new_keys = [_keys(g, s // c - o, d) for s, o in zip(seq, old)]
    hist = [torch.cat([keys[r], new_keys[r]]) for r in range(len(seq))]
    k_rows = []
    for r, (s, q) in enumerate(zip(seq, qry)):
        for p in range(s - q, s):
            ends = (p + 1) % c == 0
            k_rows.append(hist[r][p // c] if ends else torch.zeros(d, dtype=torch.bfloat16))
    k_new = torch.stack(k_rows)
    q8, w = _queries(g, n_tok, h, d, ctx.fp8, k_new)
    if pad_rows:
        again = torch.arange(pad_rows) % n_tok  # padding rows: copies of real rows (as many as asked)
        q8 = torch.cat([q8, q8[again]])
        w = torch.cat([w, w[again]])
    slots = compressed_slot_mapping(bt_full, seq, qry, bs, compress_ratio=c)
    longest = max((s // c * q for s, q in zip(seq[len(decode_lens):], qry[len(decode_lens):])), default=0)
    lim = IndexerLimits(max_model_len=max(seq), max_num_batched_tokens=max(t, len(seq)), max_num_seqs=len(seq),
                        next_n=next_n, n_heads=h, head_dim=d, topk=topk, block_size=bs, compress_ratio=c,
                        fp8_dtype=ctx.fp8, max_logits_bytes=max(4 * (max(seq) // c), longest * 4 // 3))
    sentinel = 123456

    def one(dev, backend, cache):
        md = build_metadata(seq, qry, bt_full.to(dev), slots.to(dev), lim, num_blocks=nb)
        out = torch.full((t + 2, topk), sentinel, dtype=torch.int32, device=dev)
        sparse_attn_indexer(q8.to(dev), k_new.to(dev), w.to(dev), cache, md, allocate(lim, dev), out,
                            backend=backend)
        return md, out

    md, _ = one(CPU, "reference", ref_full)  # the reference's cache bytes are the baseline
    if split and sum(ch.gather for ch in md.prefill_chunks) == len(md.prefill_chunks) and len(prefill) > 0:
        raise AssertionError("the case meant to split a prefill along its queries did not")
    _, got = one(ctx.device, ctx.op_backend, kv_full)
    ctx.sync()
    got = got.cpu()
    cache_text, cache_ok = _compare_cache(ctx, kv_full, ref_full, k_new, slots, "ue8m0")
    # judge every real row by float64 scores of its window (valid entries a prefix: min(window, topk) of
    # them); padding rows -1; rows past T untouched
    tol = 1e-5 if ctx.backend == "reference" or ctx.device.type == "cpu" else 1e-3
    worst, wrong, row = 0.0, 0, 0
    for r, (s, q) in enumerate(zip(seq, qry)):
        sc = _scores64(hist[r], q8[row : row + q], w[row : row + q], ctx.fp8)
        for j in range(q):
            n = (s - q + j + 1) // c
            sel = got[row + j].long()
            if n <= topk:
                wrong += not torch.equal(sel, torch.cat([torch.arange(n), torch.full((topk - n,), -1)]))
            elif bool(((sel < 0) | (sel >= n)).any()) or sel.unique().numel() != topk:
                wrong += 1
            else:
                vals = sc[j, :n]
                kth = vals.topk(topk).values[-1]
                short = float((kth - vals[sel]).max()) / max(float(vals.abs().max()), 1e-300)
                worst = max(worst, short)
                wrong += short > tol
        row += q
    pad_ok = bool((got[n_tok:t] == -1).all()) and bool((got[t:] == sentinel).all())
    cache_bad = cache_text.split(" of ")[0]
    text = f"{wrong}/{n_tok} rows wrong (worst {worst:.0e}), cache {cache_bad} B off"
    if not pad_ok:
        text += ", padding rows wrong"
    return text, f"{tol:.0e}, 0 B", wrong == 0 and cache_ok and pad_ok


def case_step_mxfp4(ctx: Ctx, next_n: int, tiled: bool) -> tuple[str, str, bool]:
    """One ``sparse_attn_indexer`` step on an MXFP4 cache (docs/spec.md §3a; ``tiled``: aiter's page order):
    decode requests and a prefill request whose new keys the step writes, against the reference backend's cache
    bytes (exactly) and each row's float64 scores over the MXFP4 codes."""
    g = ctx.gen(610 + next_n + tiled)
    h, d, bs, topk = 16, 128, 64, 64
    fmt = CacheFormat.tiled_mxfp4(32) if tiled else CacheFormat(values="mxfp4")
    seq, qry = [600, 300, 40, 200], [next_n, next_n, next_n, 30]
    max_blocks = max(-(-s // bs) for s in seq)
    bt = torch.arange(len(seq) * max_blocks, dtype=torch.int32).view(len(seq), max_blocks)
    nb = bt.numel()
    hist = [_keys(g, s, d) for s in seq]
    ref = new_kv_cache(nb, bs, d, mxfp4=True)
    for r, (s, q) in enumerate(zip(seq, qry)):
        write_k_cache(hist[r][: s - q], ref, slots_from_block_table(bt[r : r + 1], torch.arange(s - q)[None], bs)[0],
                      cache_format=fmt, backend="reference")
    kv = ref.to(ctx.device)
    slots = torch.cat([slots_from_block_table(bt[r : r + 1], torch.arange(s - q, s)[None], bs)[0]
                       for r, (s, q) in enumerate(zip(seq, qry))])
    k_new = torch.cat([hist[r][s - q :] for r, (s, q) in enumerate(zip(seq, qry))])
    n_tok = sum(qry)
    qv, qs = quantize_q_mxfp4(torch.randn(n_tok, h, d, generator=g) + k_new.float()[:, None, :] * 0.3)
    w = torch.randn(n_tok, h, generator=g) * (h * d) ** -0.5
    lim = IndexerLimits(max_model_len=max(seq), max_num_batched_tokens=n_tok, max_num_seqs=len(seq), next_n=next_n,
                        n_heads=h, head_dim=d, topk=topk, block_size=bs, cache_format=fmt,
                        max_logits_bytes=4 * 200 * 20)

    def one(dev, backend, cache):
        md = build_metadata(seq, qry, bt.to(dev), slots.to(dev), lim, num_blocks=nb)
        out = torch.full((n_tok, topk), -7, dtype=torch.int32, device=dev)
        sparse_attn_indexer(qv.to(dev), k_new.to(dev), w.to(dev), cache, md, allocate(lim, dev), out,
                            q_scale=qs.to(dev), backend=backend)
        return out

    one(CPU, "reference", ref)
    got = one(ctx.device, ctx.op_backend, kv)
    ctx.sync()
    got = got.cpu()
    cache_off = int((kv.cpu() != ref).sum())
    q64 = dequantize_mxfp4(qv, qs, torch.float64)
    tol = 1e-5 if ctx.device.type == "cpu" else 1e-4
    worst, wrong, row = 0.0, 0, 0
    for r, (s, q) in enumerate(zip(seq, qry)):
        k64 = dequantize_mxfp4(*quantize_k_mxfp4(hist[r]), torch.float64)
        for j in range(q):
            n = s - q + j + 1
            vals = w[row].double() @ (q64[row] @ k64[:n].T).clamp(min=0)
            sel = got[row].long()
            if n <= topk:
                wrong += not torch.equal(sel.sort().values[topk - n :], torch.arange(n))
            elif bool(((sel < 0) | (sel >= n)).any()) or sel.unique().numel() != topk:
                wrong += 1
            else:
                short = float((vals.topk(topk).values[-1] - vals[sel]).max()) / max(float(vals.abs().max()), 1e-300)
                worst = max(worst, short)
                wrong += short > tol
            row += 1
    text = f"{wrong}/{n_tok} rows wrong (worst {worst:.0e}), cache {cache_off} B off"
    return text, f"{tol:.0e}, 0 B", wrong == 0 and cache_off == 0


# ---------------------------------------------------------------------------------------------- the list
def _candidate_logits(g: torch.Generator, r: int, w: int, special: bool) -> torch.Tensor:
    x = torch.randn(r, w, generator=g)
    if special:  # ties, -inf runs (whole blocks), NaN
        x = (x * 4).round() / 4
        x[:, 64:200] = float("-inf")
        x[x == -2.75] = float("nan")
    return x


def _candidate_windows(r: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([(0 if i % 2 == 0 else 5) for i in range(r)], dtype=torch.int32)
    lens = [w, 3, 0, w // 3, w - 9, 801]
    ends = torch.tensor([min(w, int(starts[i]) + lens[i % len(lens)]) for i in range(r)], dtype=torch.int32)
    return starts, ends


def case_select(ctx: Ctx, b: int, kb: int, special: bool) -> tuple[str, str, bool]:
    """``select_candidate_blocks`` judged by :func:`sparse_indexer.testing.candidate_errors` (docs/spec.md §6a)."""
    g = ctx.gen(500 + b + kb + special)
    r, w = ctx.sizes.topk_rows, ctx.sizes.topk_width
    x = _candidate_logits(g, r, w, special)
    starts, ends = _candidate_windows(r, w)
    out = torch.full((r, kb), -7, dtype=torch.int32, device=ctx.device)
    select_candidate_blocks(x.to(ctx.device), starts.to(ctx.device), ends.to(ctx.device), out=out, block_size=b,
                            backend=ctx.op_backend)
    ctx.sync()
    wrong = len(candidate_errors(out.cpu(), x, starts, ends, b))
    return f"{wrong} of {r} rows wrong", "0 rows", wrong == 0


def case_candidate_topk(ctx: Ctx, b: int, kb: int, topk: int, special: bool) -> tuple[str, str, bool]:
    """The candidate-restricted ``top_k_per_row`` on the candidates the reference selects from other logits."""
    g = ctx.gen(600 + b + kb + special)
    r, w = ctx.sizes.topk_rows, ctx.sizes.topk_width
    src = _candidate_logits(g, r, w, special)
    x = _candidate_logits(g, r, w, special)
    starts, ends = _candidate_windows(r, w)
    cand = torch.empty(r, kb, dtype=torch.int32)
    select_candidate_blocks(src, starts, ends, out=cand, block_size=b, backend="reference")
    dev = ctx.device
    out = torch.full((r, topk), -7, dtype=torch.int32, device=dev)
    top_k_per_row(x.to(dev), starts.to(dev), ends.to(dev), out=out, candidates=cand.to(dev),
                  candidate_block_size=b, backend=ctx.op_backend)
    ctx.sync()
    wrong = len(candidate_topk_errors(out.cpu(), x, starts, ends, cand, b))
    return f"{wrong} of {r} rows wrong", "0 rows", wrong == 0


def cases(sizes: Sizes) -> list[tuple[str, str, Callable[[Ctx], tuple[str, str, bool]]]]:
    """(op, case name, function of the context) for every row of the table."""
    out = [
        ("write_k_cache", "D=128 bs=64 ue8m0", lambda c: case_write(c, 128, 64, "ue8m0", 0, False)),
        ("write_k_cache", "D=64 bs=16 plain scale, padded 4-D", lambda c: case_write(c, 64, 16, None, 36, True)),
        ("write_k_cache", "D=128 bs=1 ue8m0", lambda c: case_write(c, 128, 1, "ue8m0", 0, False)),
        ("gather_k_cache", f"D=128 bs=64 lens {list(sizes.gather_lens)}", lambda c: case_gather(c, 128, 64, 0)),
        ("gather_k_cache", "D=64 bs=16 padded stride", lambda c: case_gather(c, 64, 16, 12)),
        ("fp8_mqa_logits", "H=64 D=128 clean, 2 causal requests", lambda c: case_ragged(c, 64, 128, True)),
        ("fp8_mqa_logits", "H=32 D=64 clean=False", lambda c: case_ragged(c, 32, 64, False)),
        ("fp8_mqa_logits", "MXFP4 H=16 D=128 clean", lambda c: case_ragged_mxfp4(c, 16, 128, True)),
        ("fp8_mqa_logits", "MXFP4 H=8 D=64 clean=False", lambda c: case_ragged_mxfp4(c, 8, 64, False)),
        ("fp8_paged_mqa_logits", "MXFP4 cache: write, gather, scores D=128 bs=16",
         lambda c: case_mxfp4_cache(c, 128, 16)),
        ("fp8_paged_mqa_logits", "MXFP4 tiled:32,16,2 cache, next_n=2, H=64",
         lambda c: case_mxfp4_paged_tiled(c, 2)),
    ]
    for nn in (1, 2, 3, 4):
        out.append(("fp8_paged_mqa_logits", f"next_n={nn} context_lens [B]",
                    lambda c, nn=nn: case_paged(c, nn, False)))
    for nn in (2, 3, 4):
        out.append(("fp8_paged_mqa_logits", f"next_n={nn} context_lens [B, next_n], clean=False",
                    lambda c, nn=nn: case_paged(c, nn, True)))
    out.append(("fp8_paged_mqa_logits", "next_n=2 H=32 D=64 bs=16", lambda c: case_paged(c, 2, False, 32, 64, 16)))
    out += [
        ("top_k_per_row", "topk=2048", lambda c: case_topk(c, 2048, False, False)),
        ("top_k_per_row", "topk=2048 split rows (workspace)", lambda c: case_topk(c, 2048, True, False)),
        ("top_k_per_row", "topk=512 ties, -inf, NaN", lambda c: case_topk(c, 512, False, True)),
        ("top_k_per_row", "topk=512 in 2048 x 8 candidates", lambda c: case_candidate_topk(c, 8, 2048, 512, False)),
        ("top_k_per_row", "topk=64 in 40 x 5 candidates, ties, -inf, NaN",
         lambda c: case_candidate_topk(c, 5, 40, 64, True)),
        ("fp8_mqa_topk", "topk=64 H=32 D=64, scores returned",
         lambda c: case_ragged_topk(c, 64, None, torch.float32)),
        ("fp8_mqa_topk", "topk=128 H=32 D=64 bf16, in blocks of 5 rows",
         lambda c: case_ragged_topk(c, 128, 5, torch.bfloat16)),
        ("fp8_paged_mqa_topk", "topk=256 next_n=2 [B], scores returned",
         lambda c: case_paged_topk(c, 2, False, torch.float32, True)),
        ("fp8_paged_mqa_topk", "topk=256 next_n=3 [B, next_n] bf16, scores returned",
         lambda c: case_paged_topk(c, 3, True, torch.bfloat16, True)),
        ("fp8_paged_mqa_topk", "topk=256 next_n=1 [B], no logits",
         lambda c: case_paged_topk(c, 1, False, torch.float32, False)),
        ("select_candidate_blocks", "b=8 K_b=2048", lambda c: case_select(c, 8, 2048, False)),
        ("select_candidate_blocks", "b=8 K_b=100 ties, -inf, NaN", lambda c: case_select(c, 8, 100, True)),
        ("step", "next_n=2 packed decode + 2 prefills (split)",
         lambda c: case_step(c, 2, (2, 1, 2, 1), ((500, 210), (300, 28)), 0)),
        ("step", "next_n=4 uniform decode + prefill + 3 padding rows",
         lambda c: case_step(c, 4, (4, 4), ((400, 90),), 3)),
        ("step", "next_n=1 decode + prefill", lambda c: case_step(c, 1, (1, 1, 1), ((900, 130),), 0)),
        # DeepSeek-V4's compressed indexer: one key per 4 tokens, topk 512 (V4-Flash) and 1024 (V4-Pro)
        ("step", "C=4 topk=512 next_n=2 packed decode + prefill",
         lambda c: case_step(c, 2, (2, 1, 2), ((800, 150),), 2, c=4, topk=512)),
        ("step", "MXFP4 tiled:32,16,2 next_n=2 decode + prefill", lambda c: case_step_mxfp4(c, 2, True)),
        ("step", "C=4 topk=1024 next_n=1 decode + prefill",
         lambda c: case_step(c, 1, (1, 1), ((900, 90), (2, 5)), 0, c=4, topk=1024)),
    ]
    return out


CHECKS = ("write_k_cache", "gather_k_cache", "fp8_mqa_logits", "fp8_paged_mqa_logits", "top_k_per_row",
          "fp8_mqa_topk", "fp8_paged_mqa_topk", "select_candidate_blocks", "step")


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="device to check: cpu, cuda, cuda:N, or auto = cuda when a GPU is visible, else cpu "
                        "(default: %(default)s)")
    p.add_argument("--backend", default="all", choices=("all", "auto", *backends.names()),
                   help="backend to check against the CPU reference; all = every backend available on the device "
                        "(on the CPU: triton under its interpreter; on a GPU also the reference itself, and the "
                        "whole step with auto = the best backend of each op) (default: %(default)s)")
    p.add_argument("--op", default="all", choices=("all", *CHECKS),
                   help="check one op (or the end-to-end step) only (default: %(default)s)")
    p.add_argument("--size", default="auto", choices=("auto", "small", "full"),
                   help="problem sizes: small (seconds under the CPU interpreter) or full (GPU-sized, contexts "
                        "to 16K, top-k 2048 of 64K); auto = small on the CPU, full on a GPU (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random inputs (default: a fresh one, printed so a run can be repeated)")
    p.add_argument("--fuzz", type=int, default=None, metavar="N",
                   help="instead of the fixed cases, N random ones drawn across the contract (shapes, formats, "
                        "lengths, values), each replayable alone from the seed it prints (sparse_indexer/commands/"
                        "fuzz.py) (default: %(default)s, the fixed cases)")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="with --fuzz: worker processes (default: 4, or the core count where smaller; a cold run "
                        "on a GPU is bound by Triton's first compiles, which the processes share)")


def _backends(requested: str, device: torch.device) -> list[str]:
    if requested != "all":
        if requested == "auto":
            if device.type == "cpu":
                raise UsageError("--backend auto --device cpu: auto is the reference on the CPU, the baseline itself")
            return ["auto"]
        if requested == "reference" and device.type == "cpu":
            raise UsageError("--backend reference --device cpu: on the CPU the reference is the baseline itself; "
                             "check it on a GPU, or check triton on the CPU")
        require_backend(requested, device)
        return [requested]
    if device.type == "cpu":  # auto never picks triton on the CPU; the interpreter makes it available here
        why = _dispatch.unavailable_reason("triton", device)
        if why is not None:
            raise UsageError(f"nothing to check on the CPU besides the reference: {why}")
        return ["triton"]
    return [*_dispatch.available(device), "auto"]


def _ops_of(backend: str) -> tuple[str, ...]:
    """The cases a backend is checked with: a partial backend (one that implements some ops only) its ops;
    ``auto`` the end-to-end step (its ops are each backend's, checked in their own rows)."""
    if backend == "auto":
        return ("step",)
    ops = backends.get(backend).ops
    return CHECKS if ops is None else tuple(ops)


def _prepare_interpreter(device: torch.device, requested: str) -> str | None:
    """On the CPU, Triton kernels run under its interpreter (:func:`~.cli.use_triton_interpreter`)."""
    if requested not in ("all", "triton"):
        return None
    return use_triton_interpreter(device)


def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except Exception:  # noqa: BLE001 - triton is optional
        parts.append("no triton")
    return ", ".join(parts)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


COLUMNS = (("op", 23), ("backend", 9), ("fp8", 8), ("case", 50), ("measured", 44), ("tolerance", 16), ("", 8))


def _row(*cells) -> str:
    return "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()


def run(args) -> int:
    device = resolve_device(args.device)
    note = _prepare_interpreter(device, args.backend)
    backends = _backends(args.backend, device)
    sizes = {"small": SMALL, "full": FULL}.get(args.size, SMALL if device.type == "cpu" else FULL)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    if args.fuzz is not None:
        if args.fuzz < 1:
            raise UsageError(f"--fuzz N needs N >= 1, got {args.fuzz}")
        if args.op != "all":
            raise UsageError("--fuzz draws its ops itself: leave --op at its default")
        print(f"sparse-indexer check --fuzz on {_device_name(device)}: {', '.join(backends)} against the reference "
              f"backend on the CPU ({_versions()})" + (f"; {note}" if note else ""))
        jobs = default_jobs() if args.jobs is None else args.jobs
        if jobs < 1:
            raise UsageError(f"--jobs J needs J >= 1, got {jobs}")
        return run_fuzz(args.fuzz, seed, device, backends, sys.modules[__name__], large=sizes is FULL, jobs=jobs)
    if args.jobs is not None:
        raise UsageError("--jobs goes with --fuzz (the fixed cases run in one process)")
    todo = [c for c in cases(sizes) if args.op in ("all", c[0])]
    backends = [b for b in backends if any(op in _ops_of(b) for op, _, _ in todo)]
    if not backends:
        raise UsageError(f"--op {args.op}: no backend checked here implements it")
    print(f"sparse-indexer check on {_device_name(device)}: {', '.join(backends)} against the reference backend "
          f"on the CPU ({_versions()})")
    print(f"seed {seed} (repeat with --seed {seed}), {'small' if sizes is SMALL else 'full'} sizes"
          + (f"; {note}" if note else ""))
    for b in backends:
        _, why = formats(b, device)
        if why:
            print(f"  {b}: {why}")
    print()
    print(_row(*(name for name, _ in COLUMNS)))
    print(_row(*("-" * w for _, w in COLUMNS[:-1])))
    results: list[Case] = []
    errors: list[str] = []  # the full messages of the ERROR rows (the table cuts them)
    t0 = time.perf_counter()
    for b in backends:
        for fp8 in formats(b, device)[0]:
            ctx = Ctx(b, device, fp8, sizes, seed)
            for op, name, fn in todo:
                if op not in _ops_of(b):
                    continue
                try:
                    err, tol, ok = fn(ctx)
                    status = "ok" if ok else "MISMATCH"
                except NotImplementedError as e:
                    err, tol, status = f"not implemented: {e}"[:44], "", "n/a"
                except Exception as e:  # noqa: BLE001 - a crash is a failed case; the others still run
                    full = f"{type(e).__name__}: {e}".replace("\n", " ")
                    if e.__cause__ is not None:  # e.g. the import error behind a BackendUnavailable
                        full += f" (caused by {type(e.__cause__).__name__}: {e.__cause__})".replace("\n", " ")
                    errors.append(f"{op} / {b} / {fp8_name(fp8)} / {name}: {full}")
                    err, tol, status = full[:44], "", "ERROR"
                results.append(Case(op, name, err, tol, status))
                print(_row(op, b, fp8_name(fp8), name, err, tol, status), flush=True)
    bad = [r for r in results if r.status in ("MISMATCH", "ERROR")]
    na = sum(r.status == "n/a" for r in results)
    print(f"\n{len(results)} cases in {time.perf_counter() - t0:.1f} s: {len(results) - len(bad) - na} ok, "
          f"{sum(r.status == 'MISMATCH' for r in results)} mismatched, {sum(r.status == 'ERROR' for r in results)} "
          f"failed with an error" + (f", {na} not implemented by the backend" if na else ""))
    if errors:
        print("\nErrors in full:")
        for line in errors:
            print(f"  {line}")
    if bad:
        print(f"check FAILED (seed {seed}): the rows marked MISMATCH or ERROR above")
        return 1
    print("check passed")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparse_indexer check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_command(run, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
