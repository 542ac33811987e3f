"""Benchmark case of ``write_k_cache`` (``python -m sparse_indexer bench --cases cache``)."""

from __future__ import annotations

import torch

from ...commands.bench_cases import Case, CaseSpec, Ctx, k_str, same_bytes_copy
from ...kcache import new_kv_cache
from . import write_k_cache

__all__ = ["WriteCase", "build", "specs"]


def specs(smoke: bool = False) -> list[CaseSpec]:
    """One write of ``T`` tokens."""
    t = 1024 if smoke else 65536
    return [CaseSpec("cache", f"cache-write-{k_str(t)}", f"cache write T={t}", dict(op="write", T=t))]


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    return WriteCase(ctx, spec.params["T"])


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
        return same_bytes_copy(self.amount, self.ctx.device)

    def check(self, backend):
        ref = new_kv_cache(self.nb, self.ctx.block_size, self.ctx.head_dim, device=self.cache.device)
        write_k_cache(self.k, ref, self.slots, fp8_dtype=self.ctx.fp8, backend="reference")
        diff = int((ref != self.cache).sum())
        return diff == 0, "bytes equal" if diff == 0 else f"{diff} bytes differ"
