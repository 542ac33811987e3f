"""Benchmark cases of ``fp8_mqa_logits`` (``python -m sparse_indexer bench --cases prefill``)."""

from __future__ import annotations

import torch

from ..._bench_cases import LOGITS_RTOL, Case, CaseSpec, Ctx, k_str, queries, spread, take
from ...fp8 import quantize_k
from ...testing import logits_error
from . import fp8_mqa_logits

__all__ = ["PrefillCase", "build", "specs"]


def specs(smoke: bool = False) -> list[CaseSpec]:
    """Causal prefill logits: ``M`` queries over ``N`` keys."""
    shapes = [(64, 64), (64, 256)] if smoke else [(8192, 8192), (8192, 65536)]
    return [CaseSpec("prefill", f"prefill-{k_str(m)}x{k_str(n)}", f"prefill M={m} N={n} causal", dict(M=m, N=n))
            for m, n in shapes]


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    return PrefillCase(ctx, spec.params["M"], spec.params["N"])


class PrefillCase(Case):
    unit = "TFLOP/s"
    note = "clean=False"

    def __init__(self, ctx: Ctx, M: int, N: int):  # noqa: N803
        dev, h, d = ctx.device, ctx.heads, ctx.head_dim
        self.M, self.N = M, N
        k = torch.randn(N, d, device=dev, dtype=torch.bfloat16)
        self.k8, self.k_scale = quantize_k(k, fp8_dtype=ctx.fp8)
        self.q, self.weights = queries(ctx, M)
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
        rows = spread(self.M, 32, self.q.device)
        ks, ke = self.ks[rows], self.ke[rows]
        ref = torch.empty(rows.numel(), self.N, dtype=torch.float32, device=self.out.device)
        fp8_mqa_logits(take(self.q, rows), self.k8, self.k_scale, take(self.weights, rows), ks, ke, out=ref,
                       clean=True, backend="reference")
        cols = torch.arange(self.N, device=ref.device)
        inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
        err, _ = logits_error(self.out[rows], ref, inside, clean=False)
        return err <= LOGITS_RTOL, f"rel L2 {err:.1e} on {rows.numel()} rows"
