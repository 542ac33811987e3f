"""Reference ``fp8_mqa_logits``: exact FP8 emulation (upcast to float32, float32 accumulation), in tiles.

Temporaries are bounded: rows and key columns are processed in tiles of at most :data:`TILE_ELEMS`
``[rows, H, cols]`` float32 elements, so an ``[8192, 65536]`` call never builds an ``[H, M, N]`` tensor.
"""

from __future__ import annotations

import torch

from ..._runtime.launch import no_kernel_needed
from ...mxfp4 import mxfp4_scores

TILE_ELEMS = 1 << 24  # 64 MiB of float32 scores per tile


def tile_sizes(rows: int, heads: int, cols: int, budget: int | None = None) -> tuple[int, int]:
    """(row tile, column tile) with ``row_tile * heads * col_tile <= budget`` (default :data:`TILE_ELEMS`;
    at least one row and column)."""
    budget = TILE_ELEMS if budget is None else budget
    col_tile = max(1, min(cols, budget // max(1, heads)))
    row_tile = max(1, min(rows, budget // max(1, heads * col_tile)))
    return row_tile, col_tile


def score_tile(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_h weights[m, h] * relu(q[m, h] . k[n])`` in float32: q ``[m, H, D]``, k ``[n, D]`` float32."""
    mt, h, d = q.shape
    s = (q.reshape(mt * h, d) @ k.T).view(mt, h, -1).relu_()  # [m, H, n]
    return torch.bmm(weights.unsqueeze(1), s).squeeze(1)  # [m, n]


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, compressed=False,
                   q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_logits`; arguments are checked. Scores are float32; a bfloat16 ``out``
    receives them rounded once (``copy_``). ``compressed``: ``out`` is ``[M, W]``, row ``m`` from key ``ks[m]``.
    ``q_scale``: MXFP4 operands (docs/spec.md §3a; ``q``, ``k_fp8`` packed values, ``q_scale``, ``k_scale`` their
    scale bytes), scored by :func:`sparse_indexer.mxfp4.mxfp4_scores`.

    Windows the value checks would refuse (value checks off): ``ks`` and ``ke`` are clamped into ``[0, N]``
    (``ke <= ks``: an empty row); a compressed row keeps the first ``W`` keys of a longer window."""
    m, h, _ = q.shape
    n = k_fp8.shape[0]
    if q_scale is not None:
        _mxfp4(q, q_scale, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean, compressed)
        return
    if compressed:
        _compressed(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean)
        return
    if m == 0 or n == 0:
        if clean and out.numel():
            out.fill_(float("-inf"))
        return
    rt, ct = tile_sizes(m, h, n)
    cols_all = torch.arange(n, device=q.device)
    for r0 in range(0, m, rt):
        r1 = min(m, r0 + rt)
        qf = q[r0:r1].float()
        w = weights[r0:r1]
        ks = cu_seqlen_ks[r0:r1, None].long()
        ke = cu_seqlen_ke[r0:r1, None].long()
        for c0 in range(0, n, ct):
            c1 = min(n, c0 + ct)
            val = score_tile(qf, k_fp8[c0:c1].float(), w) * k_scale[None, c0:c1]
            cols = cols_all[None, c0:c1]
            inside = (cols >= ks) & (cols < ke)
            dst = out[r0:r1, c0:c1]
            fill = torch.full_like(val, float("-inf")) if clean else dst
            dst.copy_(torch.where(inside, val, fill))


def _compressed(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean) -> None:
    """Compressed rows: ``out[m, j] = logit[m, ks[m] + j]`` for ``j < ke[m] - ks[m]``. Each output column tile
    gathers every row's own keys (``[rows, cols, D]``), so temporaries stay within :data:`TILE_ELEMS`; no
    value-dependent shapes (the same code runs under ``torch.func`` transforms)."""
    m, h, d = q.shape
    n = k_fp8.shape[0]
    w = out.shape[1]
    if no_kernel_needed(m, n, w, out, clean):
        return
    rt, ct = tile_sizes(m, h + d, w)
    for r0 in range(0, m, rt):
        r1 = min(m, r0 + rt)
        qf = q[r0:r1].float()  # [r, H, D]
        wts = weights[r0:r1].unsqueeze(1)  # [r, 1, H]
        ks = cu_seqlen_ks[r0:r1, None].long().clamp(0, n)  # (windows clamped into [0, N])
        lens = cu_seqlen_ke[r0:r1, None].long().clamp(0, n) - ks
        for c0 in range(0, w, ct):
            c1 = min(w, c0 + ct)
            j = torch.arange(c0, c1, device=q.device)[None, :]
            key = (ks + j).clamp(0, n - 1)  # [r, c]
            k = k_fp8[key].float()  # [r, c, D]
            s = torch.bmm(qf, k.transpose(1, 2)).relu_()  # [r, H, c]
            val = torch.bmm(wts, s).squeeze(1) * k_scale[key]  # [r, c]
            inside = j < lens
            dst = out[r0:r1, c0:c1]
            fill = torch.full_like(val, float("-inf")) if clean else dst.float()
            dst.copy_(torch.where(inside, val, fill))


def _mxfp4(q, q_scale, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean, compressed) -> None:
    """MXFP4 operands: the scores of :func:`~sparse_indexer.mxfp4.mxfp4_scores` tile by tile (its ``[rows, H,
    cols, D / 32]`` temporaries within :data:`TILE_ELEMS`), windowed as the FP8 path; compressed rows (column
    ``j`` of row ``m`` is key ``ks[m] + j``) are scored one row at a time, each against its own keys."""
    m, h, _ = q.shape
    n = k_vals.shape[0]
    w = out.shape[1]
    if no_kernel_needed(m, n, w, out, clean):
        return
    nb = q_scale.shape[-1]
    rt, ct = tile_sizes(m, h * nb * 2, w)  # (float64 block products: twice the float32 elements)
    for r0 in range(0, m, rt):
        r1 = min(m, r0 + rt)
        ks = cu_seqlen_ks[r0:r1, None].long().clamp(0, n)  # (windows clamped into [0, N], as the FP8 path)
        ke = cu_seqlen_ke[r0:r1, None].long().clamp(0, n)
        for c0 in range(0, w, ct):
            c1 = min(w, c0 + ct)
            j = torch.arange(c0, c1, device=q.device)[None, :]
            if compressed:
                key = (ks + j).clamp(0, n - 1)  # [r, c]: row m's key ks[m] + j
                inside = j < ke - ks
                val = torch.empty(r1 - r0, c1 - c0, dtype=torch.float32, device=q.device)
                for i in range(r1 - r0):  # one row at a time: each row has its own keys
                    val[i] = mxfp4_scores(q[r0 + i : r0 + i + 1], q_scale[r0 + i : r0 + i + 1], k_vals[key[i]],
                                          k_scales[key[i]], weights[r0 + i : r0 + i + 1])[0]
            else:
                inside = (j >= ks) & (j < ke)
                val = mxfp4_scores(q[r0:r1], q_scale[r0:r1], k_vals[c0:c1], k_scales[c0:c1], weights[r0:r1])
            dst = out[r0:r1, c0:c1]
            fill = torch.full_like(val, float("-inf")) if clean else dst.float()
            dst.copy_(torch.where(inside, val, fill))
