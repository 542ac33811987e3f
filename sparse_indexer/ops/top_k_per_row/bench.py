"""Benchmark cases of ``top_k_per_row`` (``python -m sparse_indexer bench --cases topk``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from buffers import IndexerLimits, plan

from ...commands.bench_cases import Case, CaseSpec, Ctx, k_str, spread, topk_verdict
from ...testing import TOPK_DISTRIBUTIONS, topk_values
from ..fp8_paged_mqa_logits.bench import DecodeCase
from . import top_k_per_row

__all__ = ["TOPK_DISTRIBUTIONS", "VLLM_DECODE_TOPK", "TopKCase", "build", "specs", "topk_logits"]

VLLM_DECODE_TOPK = (512, 1024, 2048)
"""The topk values vLLM's persistent and cooperative top-k kernels take (its prefill kernel: 2048 only)."""


def specs(smoke: bool = False) -> list[CaseSpec]:
    """Window kinds and shapes ``(kind, R, W, topk)``, then every value distribution at one shape."""
    if smoke:
        shapes = [("decode", 4, 4096, 256), ("decode-nows", 4, 4096, 256), ("ragged", 4, 4096, 256),
                  ("prefill", 64, 4096, 256), ("causal", 64, 4096, 256)]
        dist = [(4, 4096, 256)]
        dists = ("logits", "95%-inf")  # (a spoiled selection on all-equal or few-valued rows can look right)
    else:
        shapes = [("decode", 64, 65536, 2048), ("decode-nows", 64, 65536, 2048), ("ragged", 64, 65536, 2048),
                  ("decode", 16, 65536, 2048), ("decode", 1, 65536, 2048), ("prefill", 8192, 65536, 2048),
                  ("causal", 8192, 65536, 2048), ("causal", 8192, 8192, 2048),
                  # DeepSeek-V4: compressed windows (64K tokens are 16K entries at ratio 4), topk 512 / 1024
                  ("decode", 64, 16384, 512), ("decode", 64, 16384, 1024), ("decode", 1, 16384, 512),
                  ("decode", 16, 65536, 512), ("decode", 64, 65536, 512), ("decode", 64, 262144, 512),
                  ("decode", 8192, 16384, 512)]
        dist = [(64, 65536, 2048), (64, 16384, 512)]
        dists = TOPK_DISTRIBUTIONS
    out = [CaseSpec("topk", _id(kind, r, w, k), f"topk {kind} R={r} W={w} topk={k}",
                    dict(kind=kind, R=r, W=w, topk=k)) for kind, r, w, k in shapes]
    # bfloat16 logits (the logits_dtype option): the same values rounded, half the bytes read
    bf16 = [shapes[0], shapes[-1]] if smoke else [("decode", 64, 65536, 2048), ("decode", 1, 65536, 2048),
                                                  ("causal", 8192, 8192, 2048), ("decode", 64, 16384, 512)]
    out += [CaseSpec("topk", _id(f"{kind}-bf16", r, w, k), f"topk {kind} bf16 R={r} W={w} topk={k}",
                     dict(kind=kind, R=r, W=w, topk=k, dtype="bfloat16")) for kind, r, w, k in bf16]
    out += [CaseSpec("topk", _id(f"dist-{name}", r, w, k), f"topk {name} R={r} W={w} topk={k}",
                     dict(kind="decode", R=r, W=w, topk=k, dist=name)) for r, w, k in dist for name in dists]
    return out


def _id(kind: str, r: int, w: int, k: int) -> str:
    """A case's id: ``topk-<kind>-<R>x<W>``, with ``-k<topk>`` unless topk is 2048."""
    return f"topk-{kind}-{k_str(r)}x{k_str(w)}" + ("" if k == 2048 else f"-k{k}")


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    p = spec.params
    return TopKCase(ctx, p["kind"], p["R"], p["W"], p["topk"], p.get("dist", "gaussian"),
                    getattr(torch, p.get("dtype", "float32")))


def topk_logits(ctx: Ctx, dist: str, r: int, w: int) -> torch.Tensor:
    """``[r, w]`` float32 logits of one of :data:`TOPK_DISTRIBUTIONS` (:func:`sparse_indexer.testing.topk_values`;
    ``logits``: the bench's own paged logits case on random FP8 queries and keys)."""
    if dist not in TOPK_DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; choose from {TOPK_DISTRIBUTIONS}")

    def real(rows: int, width: int) -> torch.Tensor:
        case = DecodeCase(ctx, rows, 1, width)
        case.fn("reference" if ctx.device.type == "cpu" else None)()
        return case.out[:, :width].contiguous()

    return topk_values(dist, r, w, device=ctx.device, real_logits=real)


class TopKCase(Case):
    """kinds: ``decode`` full rows with the planned workspace (as the step), ``decode-nows`` without one,
    ``ragged`` windows ``[0, L_r)`` with ``L_r`` in ``[W/2, W]``, ``prefill`` tail windows ``[0, W - R + j + 1)``,
    ``causal`` windows ``[0, (j + 1) W / R)``. ``dtype``: of the logits (float32, or bfloat16: the same values
    rounded)."""

    def __init__(self, ctx: Ctx, kind: str, R: int, W: int, topk: int, dist: str = "gaussian",  # noqa: N803
                 dtype: torch.dtype = torch.float32):
        dev = ctx.device
        self.R, self.W, self.topk, self.kind = R, W, topk, kind
        self.logits = topk_logits(ctx, dist, R, W).to(dtype)
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
        cells = int((self.ends.long() - self.starts.long()).clamp(min=0).sum())
        self.amount = float(cells * self.logits.element_size())
        self.workspace = None
        if kind in ("decode", "ragged"):  # as the decode step: with the planned top-k scratch
            lim = IndexerLimits(max_model_len=W, max_num_batched_tokens=R, max_num_seqs=R, topk=topk)
            self.workspace = torch.empty(plan(lim)["topk_scratch"].shape, dtype=torch.int32, device=dev)
            self.note = "with Buffers.topk_scratch as workspace (what the decode step passes)"
        elif kind == "decode-nows":
            self.note = "no workspace"

    def anchors(self, found) -> list[tuple[str, Callable[[], object]]]:
        """vLLM's kernels that apply to this case (``found.vllm_topk``: the loaded anchor module, or ``None``)."""
        mod = found.vllm_topk
        if mod is None or self.logits.dtype != torch.float32:
            return []
        lg, s, e, o = self.logits, self.starts, self.ends, self.out
        if self.kind in ("prefill", "causal"):  # vLLM's prefill kernel: topk 2048 only
            return [("vLLM prefill kernel", lambda: mod.prefill(lg, s, e, o))] if self.topk == mod.K else []
        if self.topk not in VLLM_DECODE_TOPK:
            return []
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
        rows = spread(self.R, 16, self.logits.device)
        return topk_verdict(self.out[rows], self.logits[rows], self.starts[rows], self.ends[rows])
