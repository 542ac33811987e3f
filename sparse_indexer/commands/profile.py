"""Profiling versus running: run one worst-case step and report the memory it touched.

An engine's profiling run must reserve exactly what the indexer can use at run time. The plan
(:func:`buffers.plan`) says what that is; :func:`profile_step` checks it by running the step once on the
worst-case shapes of the limits, through a record carved from a fresh arena of exactly ``plan.total_bytes``:

- the prefill whose chunk gathers the most keys, and the one whose chunk has the most logits cells, that any
  step allowed by the limits can form (:func:`buffers.plan.prefill_extremes`), so they fill ``k_fp8``,
  ``k_scale`` and ``logits``;
- a decode of ``max_num_seqs`` requests of context ``max_model_len`` (non-uniform when ``next_n > 1``), so its
  sub-batches fill the decode logits, ``qk`` and ``topk_scratch`` and the packing fills the pack fields.

Together these steps use every field of the plan in full (:func:`worst_case_steps`; ``tests/buffers`` checks
it for random limits): the plan is what the step can touch, no more.

On CUDA it reports ``torch.cuda.max_memory_allocated()`` above the level before the step (the step itself
should add nothing: it only writes the arena, the K cache and ``topk_out``, all allocated before). On the CPU,
where no allocator statistics exist, it reports the plan's bytes and checks that the arena carved for the
step has exactly that size. The fake path (``torch.compile`` tracing, meta tensors) never calls this: it is a
host-side helper for an engine's profiling run, and it raises if called under tracing.
"""

from __future__ import annotations

import attrs
import torch

from buffers import BufferPlan, IndexerLimits, carve, plan
from buffers.arena import aligned_arena
from buffers.plan import prefill_extremes

from ..kcache import compressed_slot_mapping, new_kv_cache

__all__ = ["ProfileReport", "plan_capacity", "profile_step", "step_needs", "worst_case_steps"]


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
        peaks: per plan field, the most any of the steps needed (:func:`step_needs`).
        capacity: per plan field, what the plan holds (:func:`plan_capacity`).
    """

    plan_bytes: int
    arena_bytes: int
    step_peak_bytes: int | None
    steps: tuple
    device: str
    peaks: dict = attrs.field(factory=dict)
    capacity: dict = attrs.field(factory=dict)

    @property
    def reaches_plan(self) -> bool:
        """Every field of the plan was used in full by some step: nothing reserved is out of reach."""
        return self.peaks == self.capacity

    @property
    def fits_plan(self) -> bool:
        """The steps allocated nothing beyond the arena (always true on the CPU, where it cannot be measured)."""
        return self.arena_bytes == self.plan_bytes and (self.step_peak_bytes in (None, 0))


def worst_case_steps(limits: IndexerLimits) -> list[tuple[str, list[int], list[int]]]:
    """``(name, seq_lens, query_lens)`` of steps that together use every field of ``plan(limits)`` in full.

    - ``"prefill keys"``: a prefill whose first chunk gathers the most keys any step can
      (:func:`buffers.plan.prefill_extremes`), filling ``k_fp8`` and ``k_scale``;
    - ``"prefill logits"``: a prefill whose first chunk has the most logits cells (absent when it is the same
      step); it fills ``logits`` unless the decode sub-batch is larger;
    - ``"decode"``: ``max_num_seqs`` decode requests of ``max_model_len`` context, as many tokens each as
      ``max_num_batched_tokens`` allows up to ``min(next_n, max_model_len)``, the last with one token when
      ``next_n > 1`` (a non-uniform step, so the pack fields are used); its sub-batches fill the decode part of
      ``logits``, ``qk`` and ``topk_scratch``.

    No prefill step is listed when no request can be a prefill request (``max_num_batched_tokens`` or
    ``max_model_len`` at most ``next_n``). The steps go through :func:`sparse_indexer.build_metadata`, whose
    prefill requests have more than ``next_n`` tokens: limits with a smaller ``min_prefill_query_len`` (the
    vLLM shim's, for vLLM's chunks) plan larger key fields than these steps can fill, and the report's
    ``peaks`` then stay below ``capacity`` for them.
    """
    ext = prefill_extremes(attrs.evolve(limits, min_prefill_query_len=None))
    steps = []
    if ext.keys_step is not None:
        steps.append(("prefill keys", list(ext.keys_step[0]), list(ext.keys_step[1])))
    if ext.logits_step is not None and ext.logits_step != ext.keys_step:
        steps.append(("prefill logits", list(ext.logits_step[0]), list(ext.logits_step[1])))
    L, T, S, nn = limits.max_model_len, limits.max_num_batched_tokens, limits.max_num_seqs, limits.next_n
    extra = T - S  # tokens beyond one per request (T >= S)
    most = max(1, min(nn, L))  # a request's new tokens are part of its context: query_len <= seq_len = L
    qry = [1 + min(most - 1, max(0, extra - i * (most - 1))) for i in range(S)] if most > 1 else [1] * S
    if nn > 1 and qry[-1] == nn:
        qry[-1] = 1
    steps.append(("decode", [L] * S, qry))
    return steps


_NEED_FIELDS = ("k_fp8", "k_scale", "logits", "qk", "q_pack", "w_pack", "topk_pack", "topk_scratch", "cp_scratch")


def step_needs(metadata) -> dict[str, int]:
    """What one step needs of each buffer field, in the units of :func:`plan_capacity`: rows of ``k_fp8``,
    ``k_scale``, the packs, ``topk_scratch`` and ``cp_scratch`` (context parallel: a decode sub-batch, or a
    piece of a prefill chunk), float32 cells of ``logits`` and cells per head of ``qk``
    (as :func:`sparse_indexer.indexer.check_step` asks for them)."""
    from ..indexer import decode_batch

    need = dict.fromkeys(_NEED_FIELDS, 0)
    cp_rows = metadata.limits.decode_batch_rows if metadata.limits.world_size > 1 else 0  # context parallel pieces
    for c in metadata.prefill_chunks:
        need["k_fp8"] = need["k_scale"] = max(need["k_fp8"], c.num_k_tokens)
        need["logits"] = max(need["logits"], c.num_tokens * c.logits_cols)  # compressed: [M, window]
        need["cp_scratch"] = max(need["cp_scratch"], min(c.num_tokens, cp_rows))
    dm = metadata.decode
    if dm is not None:
        rows = min(dm.num_reqs, decode_batch(metadata)) * dm.next_n
        need["logits"] = max(need["logits"], rows * dm.width)
        need["qk"] = rows * dm.width
        need["topk_scratch"] = rows
        if cp_rows:
            need["cp_scratch"] = max(need["cp_scratch"], rows)
        if not dm.uniform:
            need["q_pack"] = need["w_pack"] = need["topk_pack"] = dm.num_rows
    return need


def plan_capacity(p: BufferPlan) -> dict[str, int]:
    """What each field of a plan holds, in the units of :func:`step_needs` (0 for an absent field)."""
    cap = {}
    for name in _NEED_FIELDS:
        f = p[name] if name in p else None
        cap[name] = 0 if f is None else (f.shape[1] * f.shape[2] if name == "qk" else f.shape[0])
    return cap


def profile_step(limits: IndexerLimits, device: torch.device | str = "cpu", backend: str | None = None,
                 *, seed: int = 0) -> ProfileReport:
    """Run the worst-case prefill and decode steps of ``limits`` once and report the memory they touched.

    Allocates (outside the measured region) the arena, a K cache holding ``max_keys`` keys for every
    request, the inputs and ``topk_out``; then measures only :func:`sparse_indexer.sparse_attn_indexer`.
    Large limits need a GPU: the K cache alone is ``max_num_seqs * max_keys * (D + 4)`` bytes.
    """
    from ..indexer import sparse_attn_indexer
    from ..metadata import build_metadata

    if torch.compiler.is_compiling():
        raise RuntimeError("profile_step runs real steps; call it eagerly, never under tracing")
    device = torch.device(device)
    p = plan(limits)
    arena = aligned_arena(p.total_bytes, device)
    bufs = carve(p, arena)
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, d, bs = limits.n_heads, limits.head_dim, limits.block_size
    blocks_per_req = (limits.max_keys + bs - 1) // bs
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
        slots = compressed_slot_mapping(block_table[:n].cpu(), seq, qry, bs,
                                        compress_ratio=limits.compress_ratio).to(device)
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
    cap = plan_capacity(p)
    peaks = dict.fromkeys(cap, 0)
    for _, md in runs:
        for name, n in step_needs(md).items():
            if cap[name]:  # an absent field (qk without with_qk, packs at next_n 1) is never asked for
                peaks[name] = max(peaks[name], n)
    return ProfileReport(plan_bytes=p.total_bytes, arena_bytes=arena.numel(), step_peak_bytes=peak, steps=steps,
                         device=str(device), peaks=peaks, capacity=cap)
