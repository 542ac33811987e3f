"""``python -m sparse_indexer bench``: time every op on every backend, side by side, against measured floors.

One run measures the Triton backend, the reference backend on the same device and aiter (where installed) on

* decode logits (``fp8_paged_mqa_logits``, ``clean=False`` as the indexer step uses): ``(B, next_n, L)`` in
  ``(64, 1, 64K), (64, 2, 64K), (128, 1, 32K), (256, 1, 16K), (32, 1, 128K)``, ``H=64, D=128``, block 64;
* prefill logits (``fp8_mqa_logits``, ``clean=False``): 8K queries, causal over 8K and 64K keys (query ``j``
  of ``M`` attends keys ``[0, N - M + j + 1)``);
* top-k (``top_k_per_row``, topk 2048): decode 64 x 64K (full rows, ragged windows, with the planned workspace
  as the step passes it and without), 16 x 64K, 1 x 64K; prefill 8K x 64K (tail windows ``[0, 56K + j]`` and
  causal ``[0, 8 (j + 1))``) and 8K x 8K causal; 64 x 64K on every value distribution of
  :data:`TOPK_DISTRIBUTIONS`;
* the decode step (``indexer_decode``: paged logits + top-k as the step runs them), eager and replayed in a CUDA
  graph: ``(B, next_n, L)`` in ``(64, 1, 64K), (64, 2, 64K), (256, 1, 16K), (1, 1, 64K), (4, 1, 64K),
  (16, 1, 64K)``; a backend of some ops means ``auto`` there (``cuda``: Triton logits, CUDA top-k);
* ``write_k_cache`` and ``gather_k_cache`` of 64K tokens.

``--anchors DIR`` times vLLM's CUDA top-k kernels (a measuring instrument loaded from ``DIR/vllm_topk.py``,
never imported otherwise) beside ours on the same top-k inputs.

Each row holds the median time (CUDA events around the op only, L2 flushed by zeroing a 256 MiB buffer before
every iteration), the achieved TB/s or TFLOP/s of the op's traffic/FLOP model and its fraction of a floor
measured in the same run (a device-to-device copy for bandwidth, an FP8 ``torch._scaled_mm`` for compute),
and a spot check of the output against the reference backend on a subset of rows. The table goes to stdout;
``--out`` receives ``results.md``, ``results.json`` and ``results.png`` (matplotlib, when installed).

``--smoke`` uses tiny shapes and also runs on the CPU (``time.perf_counter``, no L2 flush).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from buffers import IndexerLimits, plan

from . import backends as _registry
from ._dispatch import BackendUnavailable, unavailable_reason
from .fp8 import fp8_name, quantize_k, quantize_q
from .kcache import new_kv_cache
from .ops._aiter import native_fp8
from .ops.fp8_mqa_logits import fp8_mqa_logits
from .ops.fp8_paged_mqa_logits import fp8_paged_mqa_logits, row_limits
from .ops.gather_k_cache import gather_k_cache
from .ops.top_k_per_row import top_k_per_row
from .ops.write_k_cache import write_k_cache
from .testing import logits_error, topk_errors

__all__ = ["CaseSpec", "add_arguments", "case_specs", "run"]

GROUPS = ("decode", "prefill", "topk", "step", "cache")
CASE_OPS = {"decode": "fp8_paged_mqa_logits", "prefill": "fp8_mqa_logits", "topk": "top_k_per_row",
            "step": "top_k_per_row", "cache": "write_k_cache"}  # a partial backend runs a group if it has this op
TOPK_DISTRIBUTIONS = ("gaussian", "logits", "ints0-3", "all-equal", "heavy", "sorted", "95%-inf", "nan+inf")
L2_FLUSH_BYTES = 256 << 20
LOGITS_RTOL = 1e-3  # relative L2 error allowed on in-window logits (float32 accumulation, any order)
HEADS, HEAD_DIM, BLOCK_SIZE = 64, 128, 64


# --------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class CaseSpec:
    """One benchmark case: ``group`` (``--cases`` selects by group or key), ``key`` and a readable title."""

    group: str
    key: str
    title: str
    params: dict = field(default_factory=dict, hash=False, compare=False)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def case_specs(smoke: bool = False) -> list[CaseSpec]:
    """The cases of a full run (or of ``--smoke``), in run order."""
    if smoke:
        decode = [(2, 1, 256), (2, 2, 256)]
        prefill = [(64, 64), (64, 256)]
        topk = [("decode", 4, 4096, 256), ("decode-nows", 4, 4096, 256), ("ragged", 4, 4096, 256),
                ("prefill", 64, 4096, 256), ("causal", 64, 4096, 256)]
        dist = (4, 4096, 256)
        dists = ("logits", "95%-inf")  # (a spoiled selection on all-equal or few-valued rows can look right)
        step = [(2, 1, 4096), (2, 2, 4096)]
        cache_tokens, cache_reqs = 1024, 4
    else:
        decode = [(64, 1, 65536), (64, 2, 65536), (128, 1, 32768), (256, 1, 16384), (32, 1, 131072)]
        prefill = [(8192, 8192), (8192, 65536)]
        topk = [("decode", 64, 65536, 2048), ("decode-nows", 64, 65536, 2048), ("ragged", 64, 65536, 2048),
                ("decode", 16, 65536, 2048), ("decode", 1, 65536, 2048), ("prefill", 8192, 65536, 2048),
                ("causal", 8192, 65536, 2048), ("causal", 8192, 8192, 2048)]
        dist = (64, 65536, 2048)
        dists = TOPK_DISTRIBUTIONS
        step = [(64, 1, 65536), (64, 2, 65536), (256, 1, 16384), (1, 1, 65536), (4, 1, 65536), (16, 1, 65536)]
        cache_tokens, cache_reqs = 65536, 16
    specs = []
    for b, n, seq in decode:
        specs.append(CaseSpec("decode", f"decode-{b}x{n}x{_k(seq)}", f"decode B={b} next_n={n} L={seq}",
                              dict(B=b, next_n=n, L=seq)))
    for m, n in prefill:
        specs.append(CaseSpec("prefill", f"prefill-{_k(m)}x{_k(n)}", f"prefill M={m} N={n} causal",
                              dict(M=m, N=n)))
    for kind, r, w, k in topk:
        specs.append(CaseSpec("topk", f"topk-{kind}-{_k(r)}x{_k(w)}", f"topk {kind} R={r} W={w} topk={k}",
                              dict(kind=kind, R=r, W=w, topk=k)))
    for name in dists:
        r, w, k = dist
        specs.append(CaseSpec("topk", f"topk-dist-{name}-{_k(r)}x{_k(w)}", f"topk {name} R={r} W={w} topk={k}",
                              dict(kind="decode", R=r, W=w, topk=k, dist=name)))
    for graph in (False, True):
        for b, n, seq in step:
            how = "graph" if graph else "eager"
            specs.append(CaseSpec("step", f"step-{how}-{b}x{n}x{_k(seq)}",
                                  f"step ({how}) B={b} next_n={n} L={seq}", dict(B=b, next_n=n, L=seq, graph=graph)))
    specs.append(CaseSpec("cache", f"cache-write-{_k(cache_tokens)}", f"cache write T={cache_tokens}",
                          dict(op="write", T=cache_tokens)))
    specs.append(CaseSpec("cache", f"cache-gather-{_k(cache_tokens)}",
                          f"cache gather T={cache_tokens} R={cache_reqs}",
                          dict(op="gather", T=cache_tokens, R=cache_reqs)))
    return specs


@dataclass
class Ctx:
    device: torch.device
    fp8: torch.dtype
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` along dim 0, also for FP8 tensors (indexed through a uint8 view)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return t.view(torch.uint8)[idx].view(t.dtype).contiguous()
    return t[idx].contiguous()


def _spread(n: int, count: int, device) -> torch.Tensor:
    """Up to ``count`` distinct row indices spread over ``[0, n)``, first and last included."""
    return torch.linspace(0, n - 1, min(n, count)).round().long().unique().to(device)


def _fill_cache(ctx: Ctx, cache: torch.Tensor, num_slots: int, chunk: int = 1 << 20) -> None:
    """Quantize random normal keys into slots ``[0, num_slots)`` (reference backend, in chunks)."""
    for t0 in range(0, num_slots, chunk):
        t1 = min(num_slots, t0 + chunk)
        k = torch.randn(t1 - t0, ctx.head_dim, device=ctx.device, dtype=torch.bfloat16)
        slots = torch.arange(t0, t1, device=ctx.device, dtype=torch.int64)
        write_k_cache(k, cache, slots, fp8_dtype=ctx.fp8, backend="reference")
        del k, slots


def _queries(ctx: Ctx, rows: int):
    """FP8 queries ``[rows, H, D]`` and weights ``[rows, H]`` with the query scale folded in (docs/spec.md §5)."""
    h, d = ctx.heads, ctx.head_dim
    q8, q_scale = quantize_q(torch.randn(rows, h, d, device=ctx.device), fp8_dtype=ctx.fp8)
    weights = (torch.randn(rows, h, device=ctx.device) * (h ** -0.5) * (d ** -0.5) * q_scale).contiguous()
    return q8, weights


class Case:
    """A built case: inputs, a preallocated output, its traffic/FLOP model, a check against the reference."""

    unit = "TB/s"  # or "TFLOP/s"
    amount = 0.0  # bytes moved or FLOPs of one call
    note = ""

    def fn(self, backend: str) -> Callable[[], object]:
        raise NotImplementedError

    def reset(self) -> None:
        """Poison the output before a backend runs, so that cells it fails to write are caught."""

    def check(self, backend: str) -> tuple[bool, str]:
        raise NotImplementedError


class DecodeCase(Case):
    note = "clean=False"

    def __init__(self, ctx: Ctx, B: int, next_n: int, L: int):  # noqa: N803 - the paper's names
        dev, bs, h, d = ctx.device, ctx.block_size, ctx.heads, ctx.head_dim
        self.B, self.next_n, self.L = B, next_n, L
        per = -(-L // bs)
        nb = B * per
        self.cache = new_kv_cache(nb, bs, d, device=dev)
        _fill_cache(ctx, self.cache, nb * bs)
        self.block_table = torch.randperm(nb, device=dev).view(B, per).to(torch.int32).contiguous()
        self.context_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        q8, self.weights = _queries(ctx, B * next_n)
        self.q = q8.view(B, next_n, h, d)
        self.out = torch.empty(B * next_n, per * bs, dtype=torch.float32, device=dev)
        self.limits = row_limits(self.context_lens, next_n)
        rows = B * next_n
        self.amount = float(B * L * (d + 4) + rows * h * d + rows * h * 4 + B * per * 4 + B * 4
                            + int(self.limits.sum()) * 4)

    def fn(self, backend):
        return lambda: fp8_paged_mqa_logits(self.q, self.cache, self.weights, self.context_lens,
                                            self.block_table, out=self.out, clean=False, backend=backend)

    def reset(self):
        self.out.fill_(float("nan"))

    def check(self, backend):
        reqs = _spread(self.B, 3, self.q.device)
        rows = (reqs[:, None] * self.next_n + torch.arange(self.next_n, device=reqs.device)).flatten()
        ref = torch.empty(rows.numel(), self.out.shape[1], dtype=torch.float32, device=self.out.device)
        fp8_paged_mqa_logits(_take(self.q, reqs), self.cache, _take(self.weights, rows),
                             _take(self.context_lens, reqs), _take(self.block_table, reqs), out=ref,
                             clean=True, backend="reference")
        cols = torch.arange(self.out.shape[1], device=ref.device)
        inside = cols[None, :] < self.limits[rows][:, None]
        err, _ = logits_error(self.out[rows], ref, inside, clean=False)
        return err <= LOGITS_RTOL, f"rel L2 {err:.1e} on {rows.numel()} rows"


class PrefillCase(Case):
    unit = "TFLOP/s"
    note = "clean=False"

    def __init__(self, ctx: Ctx, M: int, N: int):  # noqa: N803
        dev, h, d = ctx.device, ctx.heads, ctx.head_dim
        self.M, self.N = M, N
        k = torch.randn(N, d, device=dev, dtype=torch.bfloat16)
        self.k8, self.k_scale = quantize_k(k, fp8_dtype=ctx.fp8)
        self.q, self.weights = _queries(ctx, M)
        j = torch.arange(M, device=dev)
        self.ks = torch.zeros(M, dtype=torch.int32, device=dev)
        self.ke = (N - M + j + 1).clamp(0, N).to(torch.int32)
        self.out = torch.empty(M, N, dtype=torch.float32, device=dev)
        pairs = int((self.ke.long() - self.ks.long()).clamp(min=0).sum())
        self.amount = 2.0 * h * d * pairs

    def fn(self, backend):
        return lambda: fp8_mqa_logits(self.q, self.k8, self.k_scale, self.weights, self.ks, self.ke,
                                      out=self.out, clean=False, backend=backend)

    def reset(self):
        self.out.fill_(float("nan"))

    def check(self, backend):
        rows = _spread(self.M, 32, self.q.device)
        ks, ke = self.ks[rows], self.ke[rows]
        ref = torch.empty(rows.numel(), self.N, dtype=torch.float32, device=self.out.device)
        fp8_mqa_logits(_take(self.q, rows), self.k8, self.k_scale, _take(self.weights, rows), ks, ke, out=ref,
                       clean=True, backend="reference")
        cols = torch.arange(self.N, device=ref.device)
        inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
        err, _ = logits_error(self.out[rows], ref, inside, clean=False)
        return err <= LOGITS_RTOL, f"rel L2 {err:.1e} on {rows.numel()} rows"


def topk_logits(ctx: Ctx, dist: str, r: int, w: int) -> torch.Tensor:
    """``[r, w]`` float32 logits of one of :data:`TOPK_DISTRIBUTIONS` (``logits``: the paged logits op's output
    on random FP8 queries and keys)."""
    dev = ctx.device
    x = torch.randn(r, w, dtype=torch.float32, device=dev)
    if dist == "gaussian":
        return x
    if dist == "logits":
        case = DecodeCase(ctx, r, 1, w)
        case.fn("reference" if dev.type == "cpu" else None)()
        return case.out[:, :w].contiguous()
    if dist == "ints0-3":
        return torch.randint(0, 4, (r, w), device=dev).float()
    if dist == "all-equal":
        return torch.full((r, w), 0.5, device=dev)
    if dist == "heavy":
        return torch.exp(4 * x)
    if dist == "sorted":
        return x.sort(dim=1).values
    if dist == "95%-inf":
        return torch.where(torch.rand(r, w, device=dev) < 0.95, float("-inf"), x)
    if dist == "nan+inf":
        u = torch.rand(r, w, device=dev)
        x = torch.where(u < 0.01, float("nan"), x)
        x = torch.where((u >= 0.01) & (u < 0.015), float("inf"), x)
        return torch.where((u >= 0.015) & (u < 0.03), float("-inf"), x)
    raise ValueError(f"unknown distribution {dist!r}; choose from {TOPK_DISTRIBUTIONS}")


class TopKCase(Case):
    """kinds: ``decode`` full rows with the planned workspace (as the step), ``decode-nows`` without one,
    ``ragged`` windows ``[0, L_r)`` with ``L_r`` in ``[W/2, W]``, ``prefill`` tail windows ``[0, W - R + j + 1)``,
    ``causal`` windows ``[0, (j + 1) W / R)``."""

    def __init__(self, ctx: Ctx, kind: str, R: int, W: int, topk: int, dist: str = "gaussian"):  # noqa: N803
        dev = ctx.device
        self.R, self.W, self.topk, self.kind = R, W, topk, kind
        self.logits = topk_logits(ctx, dist, R, W)
        self.starts = torch.zeros(R, dtype=torch.int32, device=dev)
        j = torch.arange(R, device=dev)
        if kind == "prefill":
            self.ends = (W - R + j + 1).clamp(0, W).to(torch.int32)
        elif kind == "causal":
            self.ends = ((j + 1) * W // R).to(torch.int32)
        elif kind == "ragged":
            self.ends = torch.randint(W // 2, W + 1, (R,), dtype=torch.int32, device=dev)
        else:
            self.ends = torch.full((R,), W, dtype=torch.int32, device=dev)
        self.out = torch.empty(R, topk, dtype=torch.int32, device=dev)
        self.amount = float(int((self.ends.long() - self.starts.long()).clamp(min=0).sum()) * 4)
        self.workspace = None
        if kind in ("decode", "ragged"):  # as the decode step: with the planned top-k scratch
            lim = IndexerLimits(max_model_len=W, max_num_batched_tokens=R, max_num_seqs=R, topk=topk)
            self.workspace = torch.empty(plan(lim)["topk_scratch"].shape, dtype=torch.int32, device=dev)
            self.note = "with Buffers.topk_scratch as workspace (what the decode step passes)"
        elif kind == "decode-nows":
            self.note = "no workspace"

    def anchors(self, mod) -> list[tuple[str, Callable[[], object]]]:
        """vLLM's kernels that apply to this case (``mod``: the loaded ``vllm_topk`` anchor module)."""
        if self.topk != getattr(mod, "K", 2048):
            return []
        lg, s, e, o = self.logits, self.starts, self.ends, self.out
        if self.kind in ("prefill", "causal"):
            return [("vLLM prefill kernel", lambda: mod.prefill(lg, s, e, o))]
        found = [("vLLM persistent kernel", lambda: mod.persistent(lg, e, o))]
        if self.R <= 16:  # what vLLM's dispatcher picks for few rows on Hopper
            found.append(("vLLM cooperative kernel", lambda: mod.cooperative(lg, e, o)))
        return found

    def fn(self, backend):
        return lambda: top_k_per_row(self.logits, self.starts, self.ends, out=self.out, backend=backend,
                                     workspace=self.workspace)

    def reset(self):
        self.out.fill_(-2)

    def check(self, backend):
        rows = _spread(self.R, 16, self.logits.device)
        return _topk_verdict(self.out[rows], self.logits[rows], self.starts[rows], self.ends[rows])


def _same_bytes_copy(amount: float, device) -> Callable[[], object]:
    half = max(1, int(amount) // 2)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


class WriteCase(Case):
    def __init__(self, ctx: Ctx, T: int):  # noqa: N803
        dev, bs, d = ctx.device, ctx.block_size, ctx.head_dim
        self.ctx = ctx
        per = -(-T // bs)
        self.nb = 2 * per
        self.cache = new_kv_cache(self.nb, bs, d, device=dev)
        blocks = torch.randperm(self.nb, device=dev)[:per]
        self.slots = (blocks[:, None] * bs + torch.arange(bs, device=dev)[None, :]).flatten()[:T].contiguous()
        self.k = torch.randn(T, d, dtype=torch.bfloat16, device=dev)
        self.amount = float(T * d * 2 + T * 8 + T * (d + 4))

    def fn(self, backend):
        return lambda: write_k_cache(self.k, self.cache, self.slots, fp8_dtype=self.ctx.fp8, backend=backend)

    def reset(self):
        self.cache.zero_()

    def copy_baseline(self):
        """A device copy of the bytes the op moves (read + written), for the 'within 2x of a copy' target."""
        return _same_bytes_copy(self.amount, self.ctx.device)

    def check(self, backend):
        ref = new_kv_cache(self.nb, self.ctx.block_size, self.ctx.head_dim, device=self.cache.device)
        write_k_cache(self.k, ref, self.slots, fp8_dtype=self.ctx.fp8, backend="reference")
        diff = int((ref != self.cache).sum())
        return diff == 0, "bytes equal" if diff == 0 else f"{diff} bytes differ"


class GatherCase(Case):
    def __init__(self, ctx: Ctx, T: int, R: int):  # noqa: N803
        dev, bs, d = ctx.device, ctx.block_size, ctx.head_dim
        per_req = T // R
        per = -(-per_req // bs)
        nb = 2 * R * per
        self.cache = new_kv_cache(nb, bs, d, device=dev)
        _fill_cache(ctx, self.cache, nb * bs)
        self.block_table = torch.randperm(nb, device=dev)[: R * per].view(R, per).to(torch.int32).contiguous()
        self.cu = (torch.arange(R + 1, device=dev) * per_req).to(torch.int32)
        total = per_req * R
        self.out_k = torch.empty(total, d, dtype=ctx.fp8, device=dev)
        self.out_scale = torch.empty(total, dtype=torch.float32, device=dev)
        self.amount = float(2 * total * (d + 4) + R * per * 4 + (R + 1) * 4)

    def copy_baseline(self):
        return _same_bytes_copy(self.amount, self.cache.device)

    def fn(self, backend):
        return lambda: gather_k_cache(self.cache, self.block_table, self.cu, out_k=self.out_k,
                                      out_scale=self.out_scale, backend=backend)

    def reset(self):
        self.out_k.view(torch.uint8).fill_(0x5A)
        self.out_scale.fill_(float("nan"))

    def check(self, backend):
        rk, rs = torch.empty_like(self.out_k), torch.empty_like(self.out_scale)
        gather_k_cache(self.cache, self.block_table, self.cu, out_k=rk, out_scale=rs, backend="reference")
        ok = torch.equal(rk.view(torch.uint8), self.out_k.view(torch.uint8)) and torch.equal(
            rs.view(torch.int32), self.out_scale.view(torch.int32))
        return ok, "bytes equal" if ok else "bytes differ"


class StepCase(Case):
    """The decode step as ``indexer_decode`` runs it (paged logits into ``Buffers.logits``, top-k with
    ``Buffers.topk_scratch``), eager or replayed from a CUDA graph captured once per backend. Traffic model:
    the decode logits' bytes plus the logits read again by the top-k."""

    def __init__(self, ctx: Ctx, B: int, next_n: int, L: int, graph: bool):  # noqa: N803
        from buffers import allocate

        from .indexer import indexer_decode
        from .metadata import build_metadata

        dev, bs = ctx.device, ctx.block_size
        self.graph = graph and dev.type == "cuda"
        self.note = "CUDA graph replay" if self.graph else "eager"
        self.logits_case = DecodeCase(ctx, B, next_n, L)
        lc = self.logits_case
        lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=B * next_n, max_num_seqs=B, next_n=next_n,
                            n_heads=ctx.heads, head_dim=ctx.head_dim, block_size=bs, topk=2048 if L >= 8192 else 256,
                            prefill_k_tokens=L, max_logits_bytes=B * next_n * lc.out.shape[1] * 4, fp8_dtype=ctx.fp8)
        self.bufs = allocate(lim, dev)
        lc.out = None  # the step writes Buffers.logits
        pos = torch.cat([torch.arange(L - next_n, L) for _ in range(B)])
        req = torch.arange(B).repeat_interleave(next_n)
        bt = lc.block_table.cpu().long()
        slots = (bt[req, pos // bs] * bs + pos % bs).to(dev)
        self.md = build_metadata([L] * B, [next_n] * B, lc.block_table, slots, lim)
        self.q = lc.q.view(B * next_n, ctx.heads, ctx.head_dim)
        self.out = torch.empty(B * next_n, lim.topk, dtype=torch.int32, device=dev)
        self.rows = B * next_n
        self._decode = indexer_decode
        self._graphs = {}
        self.amount = lc.amount + float(int(lc.limits.sum()) * 4)

    def _step(self, backend):
        # a backend of some ops (cuda: top-k only) runs the step through auto (cuda: Triton logits, CUDA top-k)
        be = None if _registry.get(backend).ops is not None else backend
        if backend == "reference":
            self.note = "eager (the reference backend is not captured)"
        return lambda: self._decode(self.q, self.logits_case.weights, self.logits_case.cache, self.md, self.bufs,
                                    self.out, backend=be)

    def fn(self, backend):
        step = self._step(backend)
        if not self.graph or backend == "reference":
            return step
        if backend not in self._graphs:
            step()  # compile / load outside the capture
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            self._graphs[backend] = g
        return self._graphs[backend].replay

    def reset(self):
        self.out.fill_(-2)

    def check(self, backend):
        self.fn(backend)()  # one more step, then judge its selection on its own logits
        logits = self.bufs.logits_view(self.rows, self.md.decode.width)
        rows = _spread(self.rows, 16, logits.device)
        s, e = self.md.decode.row_starts[rows], self.md.decode.row_ends[rows]
        return _topk_verdict(self.out[rows], logits[rows], s, e)


def _topk_verdict(got, lg, s, e) -> tuple[bool, str]:
    """docs/spec.md §6 on a subset of rows (:func:`sparse_indexer.testing.topk_errors`): short rows exact, long rows
    the value multiset of the window's top-k."""
    errors = topk_errors(got, lg, s, e)
    first = f"; {errors[0]}" if errors else ""
    return not errors, f"{got.shape[0] - len(errors)}/{got.shape[0]} rows equal (multiset){first}"


def build_case(spec: CaseSpec, ctx: Ctx) -> Case:
    p = spec.params
    if spec.group == "decode":
        return DecodeCase(ctx, p["B"], p["next_n"], p["L"])
    if spec.group == "prefill":
        return PrefillCase(ctx, p["M"], p["N"])
    if spec.group == "topk":
        return TopKCase(ctx, p["kind"], p["R"], p["W"], p["topk"], p.get("dist", "gaussian"))
    if spec.group == "step":
        return StepCase(ctx, p["B"], p["next_n"], p["L"], p["graph"])
    if p["op"] == "write":
        return WriteCase(ctx, p["T"])
    return GatherCase(ctx, p["T"], p["R"])


# --------------------------------------------------------------------------------------------- timing


SLEEP_CYCLES = 1_000_000  # ~0.5 ms at 1.98 GHz: longer than the host's per-call overhead


class Timer:
    """Median-of-N timing: CUDA events around the op only, L2 flushed before every iteration (GPU);
    ``time.perf_counter`` without a flush on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.gpu = device.type == "cuda"
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.gpu else None

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def times_us(self, fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
        iters = max(1, iters)
        for _ in range(max(0, warmup)):
            fn()
        self.sync()
        if not self.gpu:
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            # a GPU-side wait first, so the host enqueues the op before the GPU reaches the start event:
            # the time is the op's device time, not the host's launch overhead (as in triton's do_bench)
            torch.cuda._sleep(SLEEP_CYCLES)
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _copy_floor(ctx: Ctx, timer: Timer, iters: int) -> dict:
    nbytes = (1 << 30) if timer.gpu else (64 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    t = statistics.median(timer.times_us(lambda: dst.copy_(src), iters, 3))
    return dict(value=2 * nbytes / (t * 1e-6) / 1e12, unit="TB/s", median_us=t,
                how=f"device-to-device copy of {nbytes >> 20} MiB (read + write)")


def _mm_floor(ctx: Ctx, timer: Timer, iters: int) -> dict:
    n = 8192 if timer.gpu else 512
    a = torch.randn(n, n, device=ctx.device).to(ctx.fp8)
    b = torch.randn(n, n, device=ctx.device).to(ctx.fp8).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), dtype=torch.float32, device=ctx.device)
    best, detail = None, {}
    for fast in (False, True):
        try:
            f = lambda fast=fast: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                   use_fast_accum=fast)
            t = statistics.median(timer.times_us(f, iters, 3))
            tf = 2.0 * n ** 3 / (t * 1e-6) / 1e12
            detail[f"fast_accum={fast}"] = tf
            best = tf if best is None else max(best, tf)
        except Exception as e:  # noqa: BLE001
            detail[f"fast_accum={fast}"] = _err(e)
    how = f"torch._scaled_mm {fp8_name(ctx.fp8)} {n}x{n}x{n}, bf16 out, best of fast_accum off/on"
    res = dict(value=best, unit="TFLOP/s", how=how, detail=detail)
    if best is None:
        res["error"] = "; ".join(f"{k}: {v}" for k, v in detail.items())
    return res


def measure_floors(ctx: Ctx, timer: Timer, iters: int) -> dict:
    """Bandwidth floor (device-to-device copy, bytes read + written per second) and compute floor
    (FP8 ``torch._scaled_mm``, best of plain and fast accumulation) measured on this device now."""
    floors: dict = {}
    for name, unit, fn in (("bandwidth", "TB/s", _copy_floor), ("compute", "TFLOP/s", _mm_floor)):
        try:
            floors[name] = fn(ctx, timer, iters)
        except Exception as e:  # noqa: BLE001 - a floor that cannot be measured is reported, not fatal
            floors[name] = dict(value=None, unit=unit, how=fn.__name__, error=_err(e))
        _free(ctx.device)
    return floors


# --------------------------------------------------------------------------------------------- run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m sparse_indexer bench``."""
    from . import bench_host

    bench_host.add_arguments(parser)  # --host: host time per eager call (sparse_indexer/bench_host.py)
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated groups ({','.join(GROUPS)}) or case keys "
                             "(e.g. decode-64x1x64K); default: all")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated subset of {','.join(_registry.names())}; default: all "
                             "(unavailable ones show as n/a with the reason)")
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per row (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="warmup calls per row (default 5)")
    parser.add_argument("--ref-iters", type=int, default=3,
                        help="timed iterations for the (slow) reference backend (default 3, 1 warmup)")
    parser.add_argument("--skip-reference", action="store_true",
                        help="do not time the reference backend (it still serves the correctness checks)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness spot checks")
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out/)")
    parser.add_argument("--device", default="cuda", help="device to run on (default cuda)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (decode B=2 L=256, prefill 64x256, top-k 4x4096 topk 256, cache 1K "
                             "tokens); also runs on the CPU")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--anchors", default=None,
                        help="folder holding vllm_topk.py (vLLM's CUDA top-k kernels, a measuring instrument): "
                             "timed beside ours on the top-k cases (default: none)")


def _err(e: BaseException, limit: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _select(specs: list[CaseSpec], cases: str | None) -> list[CaseSpec]:
    if not cases:
        return specs
    want = [c.strip() for c in cases.split(",") if c.strip()]
    known = set(GROUPS) | {s.key for s in specs}
    unknown = [c for c in want if c not in known]
    if unknown:
        keys = [s.key for s in specs]
        raise ValueError(f"unknown --cases {unknown}; choose groups {GROUPS} or keys {keys}")
    return [s for s in specs if s.group in want or s.key in want]


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        return shlex.join(["python", "-m", "sparse_indexer", *argv[1:]])
    if argv and argv[0].endswith("bench.py"):
        return shlex.join(["python", "-m", "sparse_indexer.bench", *argv[1:]])
    return shlex.join(argv)


def _version(module: str) -> str:
    try:
        from importlib import metadata

        for dist in (module, f"pytorch-{module}", f"pytorch-{module}-rocm", f"{module}-rocm"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:  # noqa: BLE001, S110 - fall through to the module's own attribute
        pass
    try:
        return str(__import__(module).__version__)
    except Exception:  # noqa: BLE001
        return "not installed"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def _load_anchors(folder: str):
    """``vllm_topk`` from ``folder`` (vLLM's top-k kernels prebuilt for the H200; measuring only)."""
    import importlib.util

    path = os.path.join(folder, "vllm_topk.py")
    spec = importlib.util.spec_from_file_location("vllm_topk_anchor", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`). Returns 0 when every check
    passed and every available backend ran, 1 otherwise, 2 on a usage error."""
    if getattr(args, "host", False):
        from . import bench_host

        return bench_host.run(args)
    opt = lambda name, default: getattr(args, name, default)
    smoke, iters, warmup = bool(opt("smoke", False)), int(opt("iters", 30)), int(opt("warmup", 5))
    ref_iters = min(iters, int(opt("ref_iters", 3)))
    skip_ref, no_check = bool(opt("skip_reference", False)), bool(opt("no_check", False))
    try:
        device = torch.device(opt("device", "cuda"))
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda but torch.cuda.is_available() is False "
                                 "(try --smoke --device cpu)")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        specs = _select(case_specs(smoke), opt("cases", None))
        known = _registry.names()  # the row order of every case: the registry's
        names = opt("backends", None) or ",".join(known)
        backends = [b.strip() for b in names.split(",") if b.strip()]
        bad = [b for b in backends if b not in known]
        if bad:
            raise ValueError(f"unknown --backends {bad}; choose from {known}")
    except (ValueError, RuntimeError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    backends = [b for b in known if b in backends]
    reasons = {b: why for b in backends if (why := unavailable_reason(b, device)) is not None}
    anchor_mod = None
    if opt("anchors", None):
        try:
            anchor_mod = _load_anchors(opt("anchors", None))
        except Exception as e:  # noqa: BLE001 - the anchors are optional; say why they are missing
            reasons["vLLM anchors"] = _err(e)
    torch.manual_seed(int(opt("seed", 0)))
    ctx = Ctx(device=device, fp8=native_fp8(device))
    timer = Timer(device)

    meta = dict(device=_device_name(device), device_str=str(device), torch=torch.__version__,
                triton=_version("triton"), aiter=_version("aiter"), hip=torch.version.hip,
                cuda=torch.version.cuda,
                fp8=fp8_name(ctx.fp8), heads=ctx.heads, head_dim=ctx.head_dim, block_size=ctx.block_size,
                iters=iters, warmup=warmup, ref_iters=ref_iters, smoke=smoke, skip_reference=skip_ref,
                timing=("CUDA events around the op, L2 flushed (zero_ of a 256 MiB buffer) before each "
                        "iteration" if timer.gpu else "time.perf_counter around the op, no L2 flush (CPU)"),
                command=_command_line(), unavailable=reasons,
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"sparse-indexer bench on {meta['device']} ({device}), torch {meta['torch']}, "
          f"triton {meta['triton']}", flush=True)
    for b, why in reasons.items():
        print(f"  {b}: n/a ({why})", flush=True)
    print("measuring floors ...", end=" ", flush=True)
    floors = measure_floors(ctx, timer, iters)
    print(", ".join(_floor_str(f) for f in floors.values()), flush=True)

    rows: list[dict] = []
    n = len(specs)
    for i, spec in enumerate(specs, 1):
        tag = f"[{i}/{n}] {spec.title}"
        print(f"{tag}: building inputs ...", flush=True)
        torch.manual_seed(int(opt("seed", 0)) + i)
        case = None
        try:
            case = build_case(spec, ctx)
            timer.sync()
            build_error = None
        except Exception as e:  # noqa: BLE001 - report and go on with the next case
            build_error = _err(e)
            print(f"{tag}: input construction failed: {build_error}", flush=True)
        for b in backends:
            if not _registry.get(b).implements(CASE_OPS[spec.group]):
                continue  # a backend of some ops only (cuda: top-k, and the step through auto)
            row = dict(case=spec.title, key=spec.key, group=spec.group, backend=b, status="ok",
                       median_us=None, iters=None, times_us=None, amount=None, achieved=None,
                       unit=case.unit if case else None, floor_fraction=None, check="", check_detail="",
                       note=case.note if case else "")
            rows.append(row)
            if b in reasons:
                row.update(status="n/a", check="n/a", check_detail=reasons[b], detail_in_header=True)
                print(f"{tag} {b} ... n/a", flush=True)
                continue
            if b == "reference" and skip_ref:
                row.update(status="skipped", check="skipped", check_detail="--skip-reference")
                print(f"{tag} {b} ... skipped", flush=True)
                continue
            if case is None:
                row.update(status="error", check="error", check_detail=f"inputs: {build_error}")
                print(f"{tag} {b} ... error (inputs)", flush=True)
                continue
            print(f"{tag} {b} ...", end=" ", flush=True)
            ref = b == "reference"
            its, wu = (ref_iters, min(warmup, 1)) if ref else (iters, warmup)
            try:
                case.reset()
                times = timer.times_us(case.fn(b), its, wu)
            except (BackendUnavailable, NotImplementedError) as e:  # this backend lacks the op or the case
                row.update(status="n/a", check="n/a", check_detail=_err(e))
                print(f"n/a ({row['check_detail']})", flush=True)
                continue
            except Exception as e:  # noqa: BLE001
                row.update(status="error", check="error", check_detail=_err(e))
                print(f"error: {row['check_detail']}", flush=True)
                _free(device)
                continue
            med = statistics.median(times)
            achieved = case.amount / (med * 1e-6) / 1e12  # TB/s or TFLOP/s
            floor = floors["compute" if case.unit == "TFLOP/s" else "bandwidth"]["value"]
            row.update(median_us=med, iters=its, times_us=times, amount=case.amount, achieved=achieved,
                       floor_fraction=(achieved / floor) if floor else None)
            if ref:
                row.update(check="ref", check_detail="the reference backend is the baseline of the checks")
            elif no_check:
                row.update(check="-", check_detail="--no-check")
            else:
                try:
                    ok, detail = case.check(b)
                    row.update(check="ok" if ok else "FAIL", check_detail=detail)
                except Exception as e:  # noqa: BLE001
                    row.update(check="error", check_detail=_err(e))
            frac = f", {row['floor_fraction']:.2f} of floor" if row["floor_fraction"] is not None else ""
            extra = f" ({row['check_detail']})" if row["check"] not in ("ok", "ref", "-") else ""
            print(f"{med:.1f} us  {achieved:.3g} {case.unit}{frac}  check {row['check']}{extra}", flush=True)
        for name, fn in (case.anchors(anchor_mod) if case is not None and anchor_mod is not None
                         and hasattr(case, "anchors") else []):
            try:
                times = timer.times_us(fn, iters, warmup)
            except Exception as e:  # noqa: BLE001
                print(f"{tag} {name} ... error: {_err(e)}", flush=True)
                continue
            med = statistics.median(times)
            achieved = case.amount / (med * 1e-6) / 1e12
            floor = floors["bandwidth"]["value"]
            rows.append(dict(case=spec.title, key=spec.key, group=spec.group, backend=name, status="ok",
                             median_us=med, iters=iters, times_us=times, amount=case.amount, achieved=achieved,
                             unit=case.unit, floor_fraction=(achieved / floor) if floor else None,
                             check="anchor", check_detail="vLLM's CUDA kernel, measuring only", note=case.note))
            print(f"{tag} {name} ... {med:.1f} us", flush=True)
        if case is not None and hasattr(case, "copy_baseline"):
            times = timer.times_us(case.copy_baseline(), iters, warmup)
            med = statistics.median(times)
            achieved = case.amount / (med * 1e-6) / 1e12
            floor = floors["bandwidth"]["value"]
            rows.append(dict(case=spec.title, key=spec.key, group=spec.group, backend="copy (same bytes)",
                             status="ok", median_us=med, iters=iters, times_us=times, amount=case.amount,
                             achieved=achieved, unit=case.unit, floor_fraction=(achieved / floor) if floor else None,
                             check="floor", check_detail="torch copy_ of the bytes the op reads + writes",
                             note=case.note))
            print(f"{tag} copy of the same bytes ... {med:.1f} us", flush=True)
        del case
        _free(device)

    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print()
    print(format_table(rows))
    out_dir = opt("out", "bench-out") or "bench-out"
    os.makedirs(out_dir, exist_ok=True)
    result = dict(meta=meta, floors=floors, rows=rows)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(format_markdown(meta, floors, rows))
    png = write_chart(rows, os.path.join(out_dir, "results.png"))
    written = ["results.md", "results.json"] + (["results.png"] if png else [])
    print(f"\nwrote {', '.join(os.path.join(out_dir, w) for w in written)}", flush=True)
    failed = [r for r in rows if r["check"] in ("FAIL", "error") or r["status"] == "error"]
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------- output


def _floor_str(f: dict) -> str:
    if f.get("value") is None:
        return f"{f['unit']} floor n/a ({f.get('error', '')})"
    return f"{f['value']:.3g} {f['unit']} ({f['how']})"


def _cells(r: dict) -> list[str]:
    if r["median_us"] is None:
        dash = r["status"] if r["status"] != "ok" else "-"
        check = r["check"]
        if r["status"] in ("n/a", "error") and r["check_detail"] and not r.get("detail_in_header"):
            check = f"{check}: {r['check_detail']}"
        return [r["case"], r["backend"], dash, dash, r["unit"] or "", "-", check]
    check = r["check"]
    if check == "ok" and r["check_detail"]:
        check = f"ok ({r['check_detail']})"
    elif check not in ("ok", "ref", "-", "n/a", "skipped", "anchor"):
        check = f"{check}: {r['check_detail']}"
    frac = f"{r['floor_fraction']:.3f}" if r["floor_fraction"] is not None else "n/a"
    return [r["case"], r["backend"], f"{r['median_us']:.1f}", f"{r['achieved']:.3g}", r["unit"], frac, check]


HEADERS = ["case", "backend", "median us", "achieved", "unit", "floor fraction", "check"]


def format_table(rows: list[dict]) -> str:
    """The result table as aligned plain text."""
    body = [_cells(r) for r in rows]
    body = [[c if len(c) <= 70 else c[:67] + "..." for c in line] for line in body]
    widths = [max([len(h)] + [len(line[i]) for line in body]) for i, h in enumerate(HEADERS)]
    fmt = lambda line: "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
    return "\n".join([fmt(HEADERS), fmt(["-" * w for w in widths]), *(fmt(line) for line in body)])


def format_markdown(meta: dict, floors: dict, rows: list[dict]) -> str:
    md = lambda s: str(s).replace("|", "\\|")
    lines = [
        "# sparse-indexer benchmark",
        "",
        f"- device: {meta['device']} (`{meta['device_str']}`)",
        f"- versions: torch {meta['torch']}, triton {meta['triton']}, aiter {meta['aiter']}"
        + (f", HIP {meta['hip']}" if meta.get("hip") else "")
        + (f", CUDA {meta['cuda']}" if meta.get("cuda") else ""),
        f"- shapes: H={meta['heads']}, D={meta['head_dim']}, block_size={meta['block_size']}, "
        f"fp8 {meta['fp8']}" + (" (--smoke)" if meta["smoke"] else ""),
        f"- timing: median of {meta['iters']} iterations after {meta['warmup']} warmup (reference backend: "
        f"{meta['ref_iters']} after 1); {meta['timing']}",
    ]
    for name, f in floors.items():
        lines.append(f"- {name} floor: " + _floor_str(f))
    lines += [
        "- logits ops timed with `clean=False` (what the indexer step uses); only in-window cells are "
        "checked",
        "- models: decode = cache bytes read sum(L)*(D+4) + q + weights + block table + logits written "
        "sum(limit)*4; prefill = 2*H*D*(in-window (query, key) pairs); top-k = window bytes read; "
        "step = decode logits + the logits read again by the top-k; "
        "cache write = k read + slots read + cache written; gather = cache read + out written",
        "- checks against the reference backend on a subset of rows: relative L2 on in-window logits "
        f"(<= {LOGITS_RTOL:g}), top-k multiset equality on the same logits, byte equality for cache ops",
    ]
    for b, why in meta.get("unavailable", {}).items():
        lines.append(f"- {b}: n/a ({md(why)})")
    lines += [f"- command: `{meta['command']}`", f"- run: {meta['started']} .. {meta.get('finished', '')}",
              ""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join(["---", "---", "---:", "---:", "---", "---:", "---"]) + "|")
    for r in rows:
        lines.append("| " + " | ".join(md(c) for c in _cells(r)) + " |")
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], path: str) -> bool:
    """Bar chart of the fraction of the floor per case and backend; False (and a warning) sans matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"warning: no PNG chart, matplotlib is not usable ({_err(e)})", file=sys.stderr, flush=True)
        return False
    cases = list(dict.fromkeys(r["key"] for r in rows))
    backends = [b for b in _registry.names() if any(r["backend"] == b and r["floor_fraction"] is not None
                                                for r in rows)]
    val = {(r["key"], r["backend"]): r["floor_fraction"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8.0, 1.0 * len(cases) + 2), 5))
    width = 0.8 / max(1, len(backends))
    for j, b in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(cases))]
        ys = [val.get((c, b)) or 0.0 for c in cases]
        bars = ax.bar(xs, ys, width, label=b)
        for bar, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:.2f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                            fontsize=7)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fraction of measured floor (copy BW / FP8 _scaled_mm)")
    ax.set_title("sparse-indexer: achieved / floor")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if backends:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":  # pragma: no cover - the CLI is python -m sparse_indexer bench
    p = argparse.ArgumentParser(prog="sparse_indexer.bench")
    add_arguments(p)
    sys.exit(run(p.parse_args()))

