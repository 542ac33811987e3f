"""Benchmark cases of the two-level indexer's ops (``python -m sparse_indexer bench --cases candidates``): a source
layer's ``select_candidate_blocks`` and a consumer layer's candidate-restricted ``top_k_per_row``, DeepSeek-V4.1's
shapes (blocks of 8 positions, 2048 candidate blocks, topk 512). With ``--anchors``, vLLM's own functions on the
same inputs: ``select_candidate_blocks`` (block scores, ``torch.topk`` over them), and ``apply_candidate_mask``
(which rewrites the logits outside the candidates to ``-inf``, on a copy here) followed by vLLM's top-k kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...commands.bench_cases import Case, CaseSpec, Ctx, k_str, spread
from ...testing import candidate_errors, candidate_topk_errors
from ..top_k_per_row import top_k_per_row
from ..top_k_per_row.bench import topk_logits
from . import num_blocks, select_candidate_blocks

__all__ = ["CandidateCase", "build", "specs"]

B, KB, TOPK = 8, 2048, 512


def specs(smoke: bool = False) -> list[CaseSpec]:
    shapes = [(4, 4096, 64)] if smoke else [(64, 65536, KB), (16, 65536, KB), (1, 65536, KB), (64, 16384, KB),
                                             (64, 131072, KB)]
    out = []
    for what in ("select", "consume"):
        for r, w, kb in shapes:
            out.append(CaseSpec("candidates", f"cand-{what}-{k_str(r)}x{k_str(w)}",
                                f"candidates {what} R={r} W={w} b={B} K_b={kb}" + ("" if what == "select" else
                                                                                    f" topk={TOPK}"),
                                dict(what=what, R=r, W=w, KB=kb)))
    return out


def build(spec: CaseSpec, ctx: Ctx) -> Case:
    p = spec.params
    return CandidateCase(ctx, p["what"], p["R"], p["W"], p["KB"])


class CandidateCase(Case):
    """``select``: ``select_candidate_blocks`` of full decode windows ``[0, W)`` with the plan's block-score
    workspace; ``consume``: the top-k of another layer's logits inside the candidates the source chose. Traffic:
    the logits cells read (the whole windows; the candidate cells for ``consume``)."""

    def __init__(self, ctx: Ctx, what: str, R: int, W: int, KB: int):  # noqa: N803
        dev = ctx.device
        self.what, self.R, self.W, self.KB = what, R, W, KB
        self.src = topk_logits(ctx, "logits" if dev.type == "cuda" else "gaussian", R, W)
        self.starts = torch.zeros(R, dtype=torch.int32, device=dev)
        self.ends = torch.full((R,), W, dtype=torch.int32, device=dev)
        self.ws = torch.empty(R, num_blocks(W, B), dtype=torch.int32, device=dev)
        self.cand = torch.empty(R, KB, dtype=torch.int32, device=dev)
        select_candidate_blocks(self.src, self.starts, self.ends, out=self.cand, block_size=B, workspace=self.ws,
                                backend="reference" if dev.type == "cpu" else None)
        if what == "select":
            self.out = torch.empty(R, KB, dtype=torch.int32, device=dev)
            self.amount = float(R * W * 4)
        else:
            self.logits = torch.randn(R, W, device=dev)
            self.masked = self.logits.clone()  # vLLM's mask rewrites its logits: its own copy
            self.out = torch.empty(R, TOPK, dtype=torch.int32, device=dev)
            self.amount = float(R * min(W, KB * B) * 4)
            self.note = "reads the candidate cells only"

    def fn(self, backend):
        if self.what == "select":
            return lambda: select_candidate_blocks(self.src, self.starts, self.ends, out=self.out, block_size=B,
                                                   workspace=self.ws, backend=backend)
        return lambda: top_k_per_row(self.logits, self.starts, self.ends, out=self.out, candidates=self.cand,
                                     candidate_block_size=B, backend=backend)

    def anchors(self, found) -> list[tuple[str, Callable[[], object]]]:
        """vLLM's functions on this case (``found.vllm_candidates``, ``found.vllm_topk``; either may be absent)."""
        vc = getattr(found, "vllm_candidates", None)
        if vc is None:
            return []
        if self.what == "select":
            out = torch.empty_like(self.out)
            return [("vLLM select_candidate_blocks",
                     lambda: vc.select_candidate_blocks(self.src, None, self.ends, self.KB, B, out))]
        vt = found.vllm_topk
        if vt is None:
            return []
        out = torch.empty_like(self.out)
        return [("vLLM apply_candidate_mask + top-k",
                 lambda: (vc.apply_candidate_mask(self.masked, None, self.ends, self.cand, B),
                          vt.persistent(self.masked, self.ends, out))),
                ("vLLM apply_candidate_mask", lambda: vc.apply_candidate_mask(self.masked, None, self.ends,
                                                                              self.cand, B))]

    def reset(self):
        self.out.fill_(-2)

    def check(self, backend):
        rows = spread(self.R, 4, self.out.device)
        got, s, e = self.out[rows].cpu(), self.starts[rows].cpu(), self.ends[rows].cpu()
        if self.what == "select":
            errors = candidate_errors(got, self.src[rows].cpu(), s, e, B)
        else:
            errors = candidate_topk_errors(got, self.logits[rows].cpu(), s, e, self.cand[rows].cpu(), B)
        first = f"; {errors[0]}" if errors else ""
        return not errors, f"{len(rows) - len(errors)}/{len(rows)} rows exact{first}"
