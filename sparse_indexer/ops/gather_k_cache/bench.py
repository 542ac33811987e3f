"""Benchmark case of ``gather_k_cache`` (``python -m sparse_indexer bench --cases cache``)."""

from __future__ import annotations

import torch

from ...commands.bench_cases import Case, CaseSpec, Ctx, fill_cache, k_str, same_bytes_copy
from ...kcache import new_kv_cache
from . import gather_k_cache

__all__ = ["GatherCase", "build", "specs"]


def specs(smoke: bool = False) -> list[CaseSpec]:
    """One gather of ``T`` tokens of ``R`` requests."""
    t, r = (1024, 4) if smoke else (65536, 16)
    return [CaseSpec("cache", f"cache-gather-{k_str(t)}", f"cache gather T={t} R={r}", dict(op="gather", T=t, R=r))]


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    return GatherCase(ctx, spec.params["T"], spec.params["R"])


class GatherCase(Case):
    def __init__(self, ctx: Ctx, T: int, R: int):  # noqa: N803
        dev, bs, d = ctx.device, ctx.block_size, ctx.head_dim
        per_req = T // R
        per = -(-per_req // bs)
        nb = 2 * R * per
        self.cache = new_kv_cache(nb, bs, d, device=dev)
        fill_cache(ctx, self.cache, nb * bs)
        self.block_table = torch.randperm(nb, device=dev)[: R * per].view(R, per).to(torch.int32).contiguous()
        self.cu = (torch.arange(R + 1, device=dev) * per_req).to(torch.int32)
        total = per_req * R
        self.out_k = torch.empty(total, d, dtype=ctx.fp8, device=dev)
        self.out_scale = torch.empty(total, dtype=torch.float32, device=dev)
        self.amount = float(2 * total * (d + 4) + R * per * 4 + (R + 1) * 4)

    def copy_baseline(self):
        return same_bytes_copy(self.amount, self.cache.device)

    def fn(self, backend):
        return lambda: gather_k_cache(self.cache, self.block_table, self.cu, out_k=self.out_k,
                                      out_scale=self.out_scale, backend=backend, cache_fp8_dtype=self.out_k.dtype)

    def reset(self):
        self.out_k.view(torch.uint8).fill_(0x5A)
        self.out_scale.fill_(float("nan"))

    def check(self, backend):
        rk, rs = torch.empty_like(self.out_k), torch.empty_like(self.out_scale)
        gather_k_cache(self.cache, self.block_table, self.cu, out_k=rk, out_scale=rs, backend="reference",
                       cache_fp8_dtype=rk.dtype)
        ok = torch.equal(rk.view(torch.uint8), self.out_k.view(torch.uint8)) and torch.equal(
            rs.view(torch.int32), self.out_scale.view(torch.int32))
        return ok, "bytes equal" if ok else "bytes differ"
