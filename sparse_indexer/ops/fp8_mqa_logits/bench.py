"""Benchmark cases of ``fp8_mqa_logits`` (``python -m sparse_indexer bench --cases prefill``)."""

from __future__ import annotations

import torch

from ...commands.bench_cases import LOGITS_RTOL, Case, CaseSpec, Ctx, k_str, queries, spread, take
from ...fp8 import quantize_k
from ...testing import logits_error
from . import fp8_mqa_logits

__all__ = ["PrefillCase", "build", "specs"]


def specs(smoke: bool = False) -> list[CaseSpec]:
    """Causal prefill logits: ``M`` queries over ``N`` keys."""
    shapes = [(64, 64), (64, 256)] if smoke else [(8192, 8192), (8192, 65536)]
    out = [CaseSpec("prefill", f"prefill-{k_str(m)}x{k_str(n)}", f"prefill M={m} N={n} causal", dict(M=m, N=n))
           for m, n in shapes]
    # bfloat16 logits (the logits_dtype option); a chunk of 4 requests, full [M, N] logits vs compressed [M, N/4]
    m, n = shapes[-1]
    out += [CaseSpec("prefill", f"prefill-{k_str(m)}x{k_str(n)}-bf16", f"prefill M={m} N={n} causal bf16 logits",
                     dict(M=m, N=n, dtype="bfloat16")),
            CaseSpec("prefill", f"prefill-4x{k_str(m // 4)}x{k_str(n // 4)}", f"prefill chunk of 4 requests "
                     f"({m // 4} queries, {n // 4} keys each) causal", dict(M=m, N=n, reqs=4)),
            CaseSpec("prefill", f"prefill-4x{k_str(m // 4)}x{k_str(n // 4)}-compressed", f"prefill chunk of 4 "
                     f"requests, compressed logits [M, {n // 4}]", dict(M=m, N=n, reqs=4, compressed=True))]
    return out


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    p = spec.params
    return PrefillCase(ctx, p["M"], p["N"], getattr(torch, p.get("dtype", "float32")), p.get("reqs", 1),
                       p.get("compressed", False))


class PrefillCase(Case):
    unit = "TFLOP/s"
    note = "clean=False"

    def __init__(self, ctx: Ctx, M: int, N: int, dtype: torch.dtype = torch.float32, reqs: int = 1,  # noqa: N803
                 compressed: bool = False):
        dev, h, d = ctx.device, ctx.heads, ctx.head_dim
        self.M, self.N = M, N
        k = torch.randn(N, d, device=dev, dtype=torch.bfloat16)
        self.k8, self.k_scale = quantize_k(k, fp8_dtype=ctx.fp8)
        self.q, self.weights = queries(ctx, M)
        # reqs equal causal requests (M/reqs queries over N/reqs keys each), as a prefill chunk holds them
        mq, nk = M // reqs, N // reqs
        j = torch.arange(M, device=dev)
        r = j // mq
        self.ks = (r * nk).to(torch.int32)
        self.ke = (r * nk + (nk - mq + j % mq + 1).clamp(0, nk)).to(torch.int32)
        self.width = nk if compressed else None
        self.out = torch.empty(M, nk if compressed else N, dtype=dtype, device=dev)
        self.rtol = LOGITS_RTOL if dtype == torch.float32 else 4e-3  # bfloat16: one rounding, 2**-9 relative
        pairs = int((self.ke.long() - self.ks.long()).clamp(min=0).sum())
        self.amount = 2.0 * h * d * pairs

    def fn(self, backend):
        return lambda: fp8_mqa_logits(self.q, self.k8, self.k_scale, self.weights, self.ks, self.ke,
                                      out=self.out, clean=False, backend=backend, max_seqlen_k=self.width)

    def anchors(self, found) -> list:
        """DeepGEMM's ragged logits on the same inputs (``found.deep_gemm``; full float32 ``[M, N]`` logits,
        ``clean_logits=False`` as here). DeepGEMM allocates its output in each call."""
        dg = found.deep_gemm
        if (dg is None or self.width is not None or self.out.dtype != torch.float32
                or self.q.dtype != torch.float8_e4m3fn):
            return []
        q, kv, w, ks, ke = self.q, (self.k8, self.k_scale), self.weights, self.ks, self.ke
        return [("DeepGEMM logits", lambda: dg.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=False))]

    def reset(self):
        self.out.fill_(float("nan"))

    def check(self, backend):
        rows = spread(self.M, 32, self.q.device)
        ks, ke = self.ks[rows], self.ke[rows]
        ref = torch.empty(rows.numel(), self.out.shape[1], dtype=torch.float32, device=self.out.device)
        fp8_mqa_logits(take(self.q, rows), self.k8, self.k_scale, take(self.weights, rows), ks, ke, out=ref,
                       clean=True, backend="reference", max_seqlen_k=self.width)
        cols = torch.arange(self.out.shape[1], device=ref.device)
        if self.width is None:
            inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
        else:
            inside = cols[None, :] < (ke - ks)[:, None]
        err, _ = logits_error(self.out[rows].float(), ref, inside, clean=False)
        return err <= self.rtol, f"rel L2 {err:.1e} on {rows.numel()} rows"
