"""``fp8_mqa_logits``: ragged (prefill) indexer scores of every query against a window of keys (docs/spec.md §5)."""

from __future__ import annotations

import torch

from ... import _checks as C
from ... import library

__all__ = ["fp8_mqa_logits"]


def fp8_mqa_logits(q: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                   cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, *, out: torch.Tensor | None = None,
                   clean: bool = True, backend: str | None = None,
                   check_values: bool | None = None, _checked: bool = False) -> torch.Tensor:
    """``out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])`` for ``ks[m] <= n < ke[m]``.

    Args:
        q: ``[M, H, D]`` fp8 (e4m3fn or e4m3fnuz) queries, their scale folded into ``weights``.
        k_fp8: ``[N, D]`` fp8 keys, same format as ``q``.
        k_scale: ``[N]`` float32 key scales.
        weights: ``[M, H]`` float32 (signed) head weights.
        cu_seqlen_ks: ``[M]`` int32, first key of each query's window (``ks``; DeepGEMM's name: per-query
            window bounds, not cumulative sums, unlike ``gather_k_cache``'s ``cu_seq_lens``).
        cu_seqlen_ke: ``[M]`` int32, one past the last key (``ke <= N``; ``ke <= ks`` is an empty window).
        out: ``[M, N]`` float32 (unit stride in the last dim), written in place; allocated when ``None``.
        clean: ``True`` writes ``-inf`` outside every window; ``False`` leaves those cells undefined.
        backend: ``None``/``"auto"`` (the best backend available on the device; the next one when it raises
            ``NotImplementedError`` for the case) or a backend's name (``sparse_indexer.backends.names()``).
        check_values: check the windows against ``N`` (reads device values: a sync on a GPU); default: on the
            CPU only.

    Returns:
        ``out``.

    ``_checked=True`` is for :func:`sparse_indexer.sparse_attn_indexer` alone (see
    :func:`sparse_indexer.top_k_per_row`).
    """
    if _checked:
        library.call("fp8_mqa_logits", backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
                     out=out, clean=bool(clean))
        return out
    C.fp8("q", q, ndim=3, last_contiguous=True)
    m, h, d = q.shape
    dev = q.device
    C.tensor("k_fp8", k_fp8, ndim=2, dtypes=q.dtype, device=dev, shape=(None, d), last_contiguous=True)
    n = k_fp8.shape[0]
    C.tensor("k_scale", k_scale, dtypes=torch.float32, device=dev, shape=(n,), contiguous=True)
    C.tensor("weights", weights, dtypes=torch.float32, device=dev, shape=(m, h), last_contiguous=True)
    C.tensor("cu_seqlen_ks", cu_seqlen_ks, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,), contiguous=True)
    C.tensor("cu_seqlen_ke", cu_seqlen_ke, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,), contiguous=True)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=dev)
    else:
        C.tensor("out", out, dtypes=torch.float32, device=dev, shape=(m, n), last_contiguous=True)
        C.no_alias("out", out, q=q, k_fp8=k_fp8, k_scale=k_scale, weights=weights, cu_seqlen_ks=cu_seqlen_ks,
                   cu_seqlen_ke=cu_seqlen_ke)
    if C.want_value_checks(check_values, cu_seqlen_ks, cu_seqlen_ke):
        nonempty = lambda: cu_seqlen_ke > cu_seqlen_ks  # noqa: E731 - built only when a value is out of range
        C.values_in("cu_seqlen_ks", cu_seqlen_ks, 0, None, "window starts must be >= 0", mask=nonempty)
        C.values_in("cu_seqlen_ke", cu_seqlen_ke, None, n + 1, lambda: f"window ends must be <= N = {n}",
                    mask=nonempty)
    library.call("fp8_mqa_logits", backend, dev, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
                 clean=bool(clean))
    return out
