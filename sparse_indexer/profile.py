"""Profiling versus running: run one worst-case step and report the memory it touched.

An engine's profiling run must reserve exactly what the indexer can use at run time. The plan
(:func:`buffers.plan`) says what that is; :func:`profile_step` checks it by running the step once on the
worst-case shapes of the limits, through a record carved from a fresh arena of exactly ``plan.total_bytes``:

- a prefill of ``max_num_batched_tokens`` query tokens whose requests have ``max_model_len`` contexts
  (as many full-length requests as the tokens allow), so prefill chunks fill ``k_fp8`` and ``logits``;
- a uniform decode of ``max_num_seqs`` requests of ``next_n`` tokens, each with context ``max_model_len``,
  so the decode logits fill ``[max_num_seqs * next_n, max_model_len]``.

On CUDA it reports ``torch.cuda.max_memory_allocated()`` above the level before the step (the step itself
should add nothing: it only writes the arena, the K cache and ``topk_out``, all allocated before). On the CPU,
where no allocator statistics exist, it reports the plan's bytes and checks that the arena carved for the
step has exactly that size. The fake path (``torch.compile`` tracing, meta tensors) never calls this: it is a
host-side helper for an engine's profiling run, and it raises if called under tracing.
"""

from __future__ import annotations

import attrs
import torch

from buffers import IndexerLimits, carve, plan
from buffers.arena import aligned_arena

from .kcache import new_kv_cache, slots_from_block_table

__all__ = ["ProfileReport", "profile_step", "worst_case_steps"]


@attrs.frozen(kw_only=True)
class ProfileReport:
    """What one worst-case run touched.

    Attributes:
        plan_bytes: ``plan(limits).total_bytes``, what the engine reserves for the indexer's scratch.
        arena_bytes: bytes of the arena the step ran on (== ``plan_bytes``).
        step_peak_bytes: device memory allocated by the steps above what existed before them (CUDA:
            ``max_memory_allocated`` delta; ``None`` on the CPU, which has no allocator statistics).
        steps: ``(name, num_tokens, prefill_chunks, decode_rows)`` of each step run.
        device: where it ran.
    """

    plan_bytes: int
    arena_bytes: int
    step_peak_bytes: int | None
    steps: tuple
    device: str

    @property
    def fits_plan(self) -> bool:
        """The steps allocated nothing beyond the arena (always true on the CPU, where it cannot be measured)."""
        return self.arena_bytes == self.plan_bytes and (self.step_peak_bytes in (None, 0))


def worst_case_steps(limits: IndexerLimits) -> list[tuple[str, list[int], list[int]]]:
    """(name, seq_lens, query_lens) of the worst-case prefill and decode steps of ``limits``."""
    L, T = limits.max_model_len, limits.max_num_batched_tokens
    seq, qry = [], []
    left = T
    while left > 0 and len(seq) < limits.max_num_seqs:
        q = min(left, L)
        if q <= limits.next_n:  # would be a decode request; fold into the previous prefill
            break
        seq.append(L)
        qry.append(q)
        left -= q
    nd = limits.max_num_seqs
    while nd * limits.next_n > T:
        nd -= 1
    return [("prefill", seq, qry), ("decode", [L] * nd, [limits.next_n] * nd)]


def profile_step(limits: IndexerLimits, device: torch.device | str = "cpu", backend: str | None = None,
                 *, seed: int = 0) -> ProfileReport:
    """Run the worst-case prefill and decode steps of ``limits`` once and report the memory they touched.

    Allocates (outside the measured region) the arena, a K cache holding ``max_model_len`` tokens for every
    request, the inputs and ``topk_out``; then measures only :func:`sparse_indexer.sparse_attn_indexer`.
    Large limits need a GPU: the K cache alone is ``max_num_seqs * max_model_len * (D + 4)`` bytes.
    """
    from .indexer import sparse_attn_indexer
    from .metadata import build_metadata

    if torch.compiler.is_compiling():
        raise RuntimeError("profile_step runs real steps; call it eagerly, never under tracing")
    device = torch.device(device)
    p = plan(limits)
    arena = aligned_arena(p.total_bytes, device)
    bufs = carve(p, arena)
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, d, bs = limits.n_heads, limits.head_dim, limits.block_size
    L = limits.max_model_len
    blocks_per_req = (L + bs - 1) // bs
    max_reqs = limits.max_num_seqs
    kv = new_kv_cache(max_reqs * blocks_per_req, bs, d, device=device)
    block_table = torch.arange(max_reqs * blocks_per_req, dtype=torch.int32, device=device).view(
        max_reqs, blocks_per_req)
    # the cache holds zeros: values do not change which memory the step touches
    t_max = limits.max_num_batched_tokens
    topk_out = torch.empty(t_max, limits.topk, dtype=torch.int32, device=device)
    q = (torch.randn(t_max, h, d, generator=g) * 2).to(limits.fp8_dtype).to(device)
    k = torch.randn(t_max, d, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(t_max, h, generator=g) / (h * d) ** 0.5).to(device)
    runs = []
    for name, seq, qry in worst_case_steps(limits):
        n = len(seq)
        pos = torch.cat([torch.arange(s - q_, s) for s, q_ in zip(seq, qry)]) if n else torch.empty(0)
        req = torch.cat([torch.full((q_,), r) for r, q_ in enumerate(qry)]) if n else torch.empty(0)
        slots = slots_from_block_table(block_table[:n].cpu()[req.long()], pos.long()[:, None], bs)[:, 0].to(device)
        md = build_metadata(seq, qry, block_table[:n], slots, limits, device=device, num_blocks=kv.shape[0])
        runs.append((name, md))
    # warm up (first-call costs such as kernel compilation are not the step's memory)
    for _, md in runs:
        sparse_attn_indexer(q, k, w, kv, md, bufs, topk_out, backend=backend)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    for _, md in runs:
        sparse_attn_indexer(q, k, w, kv, md, bufs, topk_out, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    steps = tuple((name, md.num_tokens, len(md.prefill_chunks), md.decode.num_rows if md.decode else 0)
                  for name, md in runs)
    return ProfileReport(plan_bytes=p.total_bytes, arena_bytes=arena.numel(), step_peak_bytes=peak, steps=steps,
                         device=str(device))
