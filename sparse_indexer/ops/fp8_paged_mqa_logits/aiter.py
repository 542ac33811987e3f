"""aiter backend of ``fp8_paged_mqa_logits`` (ROCm; aiter is imported lazily, inside the call).

* gfx942 / gfx950: ``deepgemm_fp8_paged_mqa_logits`` writes ``out`` directly, reading the preshuffled cache
  when the block size is a multiple of 16 (``Preshuffle=True``, see ``write_k_cache/aiter.py``) and the plain
  one for block size 1. The FP8 format must be the architecture's own (gfx942: e4m3fnuz, gfx950: e4m3fn):
  converting a whole paged cache per step is not an option, so another format raises ``NotImplementedError``
  (the cache is then in the plain layout and auto falls back to Triton).
* other AMD GPUs: ``deepgemm_fp8_paged_mqa_logits_stage1`` writes per-head scores into the caller's ``qk``
  scratch (``Buffers.qk``, planned with ``IndexerLimits(with_qk=True)``), summed over heads into ``out``.
  Block size 1 only; without ``qk`` it raises ``NotImplementedError``.

* gfx950, MXFP4 (docs/spec.md §3a): ``paged_mxfp4_mqa_logits`` (aiter's paged MXFP4 kernel,
  ``aiter.ops.triton.attention.pa_mqa_logits_mxfp4``) reads the cache in place in the tiled order its
  ``cache_format(H, D, block_size)`` describes (``CacheFormat.tiled_mxfp4``); another order raises
  ``NotImplementedError``, as does any other architecture.

aiter takes one context length per request; :func:`per_sequence_context_lens` derives it from our 1-D or 2-D
``context_lens``. aiter does not fill cells outside the windows; ``clean=True`` fills them afterwards.
"""

from __future__ import annotations

import torch

from .._aiter import NATIVE_FP8, aiter_triton_module, gcn_arch, preshuffled
from .reference import row_limits

__all__ = ["fp8_paged_mqa_logits", "kernel_for", "mask_outside", "per_sequence_context_lens"]

MASK_TILE_ELEMS = 1 << 24


def per_sequence_context_lens(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """``[B]`` int32 lengths ``L`` for aiter's causal rule ``limit[b, j] = L[b] - next_n + j + 1``.

    1-D input is already that. For 2-D ``[B, next_n]`` limits, ``L[b] = max_j (limit[b, j] - j) + next_n - 1``
    over the rows with ``limit > 0`` (0 when none): exact for causal rows (uniform decode, vLLM's
    ``clamp(L - next_n + j + 1, 0)``), and for packed decode (real slots first, padded slots 0) exact on the
    real slots while the padded slots get a longer window that top-k never reads (their keys lie within the
    request's block-table row, which must hold valid block ids, as vLLM's zero-padded tables do).
    """
    if context_lens.dim() == 1:
        return context_lens.to(torch.int32)
    j = torch.arange(context_lens.shape[1], device=context_lens.device)
    lim = context_lens.long()
    shifted = torch.where(lim > 0, lim - j, torch.iinfo(torch.int64).min)
    length = shifted.amax(1) + next_n - 1
    return torch.where((lim > 0).any(1), length, 0).to(torch.int32)


def mask_outside(out: torch.Tensor, limits: torch.Tensor) -> None:
    """``out[r, p] = -inf`` for ``p >= limits[r]``, in row tiles (bounded temporaries)."""
    r, w = out.shape
    cols = torch.arange(w, device=out.device)
    rt = max(1, min(r, MASK_TILE_ELEMS // max(1, w)))
    for r0 in range(0, r, rt):
        r1 = min(r, r0 + rt)
        out[r0:r1].masked_fill_(cols[None, :] >= limits[r0:r1, None], float("-inf"))


def kernel_for(q, kv_cache, qk=None) -> str:
    """The aiter kernel that reads this call: ``"native"`` (gfx942/gfx950: ``deepgemm_fp8_paged_mqa_logits``, the
    architecture's own FP8 format, block size 1 or a preshuffled multiple of 16) or ``"stage1"`` (other AMD GPUs:
    block size 1, per-head scores into ``qk``); ``NotImplementedError`` when neither does."""
    arch = gcn_arch(q.device)
    bs = kv_cache.shape[1]
    if arch in NATIVE_FP8:
        if q.dtype != NATIVE_FP8[arch]:
            raise NotImplementedError(
                f"aiter's paged logits on {arch} read {NATIVE_FP8[arch]}, got {q.dtype}; plan the engine with "
                f"IndexerLimits(fp8_dtype={NATIVE_FP8[arch]})"
            )
        if not preshuffled(bs, q.dtype, arch) and bs != 1:
            raise NotImplementedError(f"aiter's paged logits read block_size 1 or a multiple of 16, got {bs}")
        return "native"
    if bs != 1:
        raise NotImplementedError(f"aiter's stage1 paged logits ({arch}) read block_size 1, got {bs}")
    if qk is None:
        raise NotImplementedError(
            f"aiter's stage1 paged logits ({arch}) need the qk scratch: plan IndexerLimits(with_qk=True) and "
            f"pass Buffers.qk_view(rows, W)"
        )
    return "stage1"


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, *, out, clean, qk=None,
                         indices=None, cache_fp8_dtype=None, cache_scale="float32", cache_order="flat",
                         cache_values="fp8", q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_logits`; ``kv_cache`` is the 3-D view, arguments checked.

    ``qk``: ``[H, B * next_n, W]`` float32 scratch (``Buffers.qk_view``), needed off gfx942/gfx950 only.
    aiter's kernels write float32 logits: a bfloat16 ``out`` raises ``NotImplementedError`` (auto then runs
    Triton). ``indices`` (row -> request map): the block-table rows are gathered first (``[B, max_blocks]``
    int32, a small allocation), since aiter takes one block-table row per query entry. A declared format is read
    only where it is this backend's own (float32 scales; the preshuffled order exactly where its gfx942/gfx950
    kernel reads it); anything else raises ``NotImplementedError`` (auto falls back).
    """
    if cache_values == "mxfp4":
        _mxfp4(q, q_scale, kv_cache, weights, context_lens, block_table, out, clean, indices, cache_order)
        return
    if q_scale is not None:
        raise NotImplementedError("q_scale (MXFP4 queries) needs an MXFP4 cache")
    if cache_fp8_dtype is not None and cache_fp8_dtype != q.dtype:
        raise NotImplementedError(f"{q.dtype} queries against a {cache_fp8_dtype} cache (a declared mix of formats)")
    if cache_scale != "float32":
        raise NotImplementedError(f"aiter's paged logits read float32 scales, not {cache_scale!r}")
    if cache_order == "preshuffled" and not preshuffled(kv_cache.shape[1], q.dtype, gcn_arch(q.device)):
        raise NotImplementedError("aiter's paged logits read the preshuffled order only on gfx942 (e4m3fnuz) / gfx950 "
                                  "(e4m3fn) with a block_size multiple of 16")
    b, nn, h, _ = q.shape
    w = out.shape[1]
    if out.dtype != torch.float32:
        raise NotImplementedError(f"aiter's paged logits write float32, got out of dtype {out.dtype}")
    if b == 0 or w == 0:
        return
    if indices is not None:
        block_table = block_table.index_select(0, indices.long())
    arch = gcn_arch(q.device)
    bs = kv_cache.shape[1]
    kv4 = kv_cache.unsqueeze(2)  # [num_blocks, block_size, 1, D + 4], as aiter expects
    if kernel_for(q, kv_cache, qk) == "native":
        shuffle = preshuffled(bs, q.dtype, arch)
        mod = aiter_triton_module("pa_mqa_logits")
        if clean:
            out.fill_(float("-inf"))
        mod.deepgemm_fp8_paged_mqa_logits(q, kv4, weights, out, per_sequence_context_lens(context_lens, nn),
                                          block_table, w, Preshuffle=shuffle, KVBlockSize=bs, ChunkK=256,
                                          WavePerEU=2)
    else:
        if tuple(qk.shape) != (h, b * nn, w):
            raise ValueError(f"qk must be [{h}, {b * nn}, {w}], got {tuple(qk.shape)}")
        mod = aiter_triton_module("pa_mqa_logits")
        qk.fill_(float("-inf"))
        mod.deepgemm_fp8_paged_mqa_logits_stage1(q, kv4, weights, qk, per_sequence_context_lens(context_lens, nn),
                                                 block_table, w, ChunkQ=h)
        torch.sum(qk, dim=0, out=out)
    if clean:
        mask_outside(out, row_limits(context_lens, nn))


def mxfp4_order(num_heads: int, head_dim: int, block_size: int) -> str:
    """The MXFP4 byte order aiter's paged MXFP4 kernel reads for ``num_heads`` heads of ``head_dim`` in
    ``block_size``-entry pages (``"tiled:N,C,L"``, from its ``cache_format``; ``L = 64 // N`` unless it says)."""
    fmt = aiter_triton_module("pa_mqa_logits_mxfp4").cache_format(num_heads, head_dim, block_size)
    n = int(fmt["n_per_tile"])
    return f"tiled:{n},{int(fmt['d_per_tile'])},{int(fmt.get('scale_lanes', 64 // n))}"


def _mxfp4(q, q_scale, kv_cache, weights, context_lens, block_table, out, clean, indices, order) -> None:
    """MXFP4 queries against an MXFP4 cache through aiter's ``paged_mxfp4_mqa_logits`` (gfx950): one context length
    per request (:func:`per_sequence_context_lens`) and every row's own bound (``row_ends``), float32 logits
    written inside the windows (``clean_logits=False``; ``clean`` fills the rest afterwards)."""
    arch = gcn_arch(q.device)
    if arch != "gfx950":
        raise NotImplementedError(f"aiter's paged MXFP4 logits run on gfx950, not {arch}")
    b, nn, h, half = q.shape
    bs = kv_cache.shape[1]
    want = mxfp4_order(h, 2 * half, bs)
    if order != want:
        raise NotImplementedError(f"aiter's paged MXFP4 logits read the order {want!r} for H={h}, D={2 * half}, "
                                  f"block_size={bs}; the cache is {order!r}")
    if out.dtype != torch.float32:
        raise NotImplementedError(f"aiter's paged MXFP4 logits write float32, got out of dtype {out.dtype}")
    w = out.shape[1]
    if b == 0 or w == 0:
        return
    if indices is not None:
        block_table = block_table.index_select(0, indices.long())
    limits = row_limits(context_lens, nn).to(torch.int32)
    mod = aiter_triton_module("pa_mqa_logits_mxfp4")
    mod.paged_mxfp4_mqa_logits(q, q_scale, kv_cache.unsqueeze(2), weights, per_sequence_context_lens(context_lens, nn),
                               block_table, w, out_logits=out, clean_logits=False, row_ends=limits)
    if clean:
        mask_outside(out, limits)
