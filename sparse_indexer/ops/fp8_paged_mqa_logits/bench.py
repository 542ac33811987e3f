"""Benchmark cases of ``fp8_paged_mqa_logits`` (``python -m sparse_indexer bench --cases decode``)."""

from __future__ import annotations

import torch

from ...commands.bench_cases import LOGITS_RTOL, Case, CaseSpec, Ctx, fill_cache, k_str, queries, spread, take
from ...kcache import new_kv_cache
from ...testing import logits_error
from . import fp8_paged_mqa_logits, row_limits

__all__ = ["DecodeCase", "build", "specs"]


def specs(smoke: bool = False) -> list[CaseSpec]:
    """Decode logits: ``(B, next_n, L)`` with a 64-token block size, ``clean=False`` as the step runs it."""
    shapes = ([(2, 1, 256), (2, 2, 256)] if smoke else
              [(64, 1, 65536), (64, 2, 65536), (128, 1, 32768), (256, 1, 16384), (32, 1, 131072), (64, 3, 65536),
               (64, 4, 65536)])
    out = [CaseSpec("decode", f"decode-{b}x{n}x{k_str(seq)}", f"decode B={b} next_n={n} L={seq}",
                    dict(B=b, next_n=n, L=seq)) for b, n, seq in shapes]
    # bfloat16 logits (the logits_dtype option): half the logits bytes written
    b, n, seq = shapes[0]
    out.append(CaseSpec("decode", f"decode-{b}x{n}x{k_str(seq)}-bf16", f"decode B={b} next_n={n} L={seq} bf16 logits",
                        dict(B=b, next_n=n, L=seq, dtype="bfloat16")))
    return out


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    p = spec.params
    return DecodeCase(ctx, p["B"], p["next_n"], p["L"], getattr(torch, p.get("dtype", "float32")))


class DecodeCase(Case):
    note = "clean=False"

    def __init__(self, ctx: Ctx, B: int, next_n: int, L: int, dtype: torch.dtype = torch.float32):  # noqa: N803
        dev, bs, h, d = ctx.device, ctx.block_size, ctx.heads, ctx.head_dim
        self.B, self.next_n, self.L = B, next_n, L
        per = -(-L // bs)
        nb = B * per
        self.cache = new_kv_cache(nb, bs, d, device=dev)
        fill_cache(ctx, self.cache, nb * bs)
        self.block_table = torch.randperm(nb, device=dev).view(B, per).to(torch.int32).contiguous()
        self.context_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        q8, self.weights = queries(ctx, B * next_n)
        self.q = q8.view(B, next_n, h, d)
        self.out = torch.empty(B * next_n, per * bs, dtype=dtype, device=dev)
        self.limits = row_limits(self.context_lens, next_n)
        rows = B * next_n
        self.amount = float(B * L * (d + 4) + rows * h * d + rows * h * 4 + B * per * 4 + B * 4
                            + int(self.limits.sum()) * dtype.itemsize)
        self.rtol = LOGITS_RTOL if dtype == torch.float32 else 4e-3  # bfloat16: one rounding, 2**-9 relative

    def fn(self, backend):
        return lambda: fp8_paged_mqa_logits(self.q, self.cache, self.weights, self.context_lens,
                                            self.block_table, out=self.out, clean=False, backend=backend,
                                            cache_fp8_dtype=self.q.dtype)

    def anchors(self, found) -> list:
        """DeepGEMM's paged logits on the same inputs (``found.deep_gemm``; SM90: H 32/64, block 64, next_n 1-2, FP8
        e4m3fn keys, float32 logits; its 2-D per-token lengths, schedule made once outside the timed call, and
        ``clean_logits=False`` as here). DeepGEMM allocates its output in each call."""
        dg = found.deep_gemm
        if (dg is None or self.next_n > 2 or self.out.dtype != torch.float32 or self.q.dtype != torch.float8_e4m3fn
                or self.cache.shape[1] != 64):
            return []
        nb, bs, width = self.cache.shape
        kv4 = self.cache.view(nb, bs, 1, width)
        lens2d = self.limits.view(self.B, self.next_n).to(torch.int32).contiguous()
        sched = dg.get_paged_mqa_logits_metadata(lens2d, bs, dg.get_num_sms())
        q, w, bt, cols = self.q, self.weights, self.block_table, self.out.shape[1]
        return [("DeepGEMM paged logits", lambda: dg.fp8_paged_mqa_logits(q, kv4, w, lens2d, bt, sched, cols, False))]

    def reset(self):
        self.out.fill_(float("nan"))

    def check(self, backend):
        reqs = spread(self.B, 3, self.q.device)
        rows = (reqs[:, None] * self.next_n + torch.arange(self.next_n, device=reqs.device)).flatten()
        ref = torch.empty(rows.numel(), self.out.shape[1], dtype=torch.float32, device=self.out.device)
        fp8_paged_mqa_logits(take(self.q, reqs), self.cache, take(self.weights, rows),
                             take(self.context_lens, reqs), take(self.block_table, reqs), out=ref,
                             clean=True, backend="reference", cache_fp8_dtype=self.q.dtype)
        cols = torch.arange(self.out.shape[1], device=ref.device)
        inside = cols[None, :] < self.limits[rows][:, None]
        err, _ = logits_error(self.out[rows].float(), ref, inside, clean=False)
        return err <= self.rtol, f"rel L2 {err:.1e} on {rows.numel()} rows"
