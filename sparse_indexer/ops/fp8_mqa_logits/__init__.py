"""``fp8_mqa_logits``: ragged (prefill) indexer scores of every query against a window of keys (docs/spec.md §5)."""

from __future__ import annotations

import torch

from ..._runtime import checks as C
from ..._runtime import library

__all__ = ["LOGITS_DTYPES", "check_ragged_inputs", "check_ragged_mxfp4_inputs", "check_ragged_windows",
           "fp8_mqa_logits"]

LOGITS_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes both logits ops write (``out``'s dtype; docs/spec.md §5)."""


def check_ragged_inputs(q: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                        cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor) -> tuple[int, int, torch.device]:
    """Check the inputs of a ragged (prefill) call (everything but its outputs and value checks): ``q [M, H, D]``
    fp8, ``k_fp8 [N, D]`` fp8 (any FP8 format: another one than ``q``'s is an explicit mix), both with unit last
    stride, ``k_scale [N]`` float32, ``weights [M, H]`` float32, ``cu_seqlen_ks``/``cu_seqlen_ke [M]`` int32, all on
    ``q``'s device. Returns ``(M, N, device)``; ``TypeError``/``ValueError`` naming the argument otherwise."""
    C.fp8("q", q, ndim=3, last_contiguous=True)
    m, h, d = q.shape
    dev = q.device
    # (any FP8 format: keys in another one than q's are an explicit mix)
    C.fp8("k_fp8", k_fp8, ndim=2, device=dev, shape=(None, d), last_contiguous=True)
    n = k_fp8.shape[0]
    C.tensor("k_scale", k_scale, dtypes=torch.float32, device=dev, shape=(n,), contiguous=True)
    C.tensor("weights", weights, dtypes=torch.float32, device=dev, shape=(m, h), last_contiguous=True)
    C.tensor("cu_seqlen_ks", cu_seqlen_ks, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,), contiguous=True)
    C.tensor("cu_seqlen_ke", cu_seqlen_ke, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,), contiguous=True)
    return m, n, dev


def fp8_mqa_logits(q: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                   cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, *, out: torch.Tensor | None = None,
                   clean: bool = True, backend: str | None = None,
                   check_values: bool | None = None, max_seqlen_k: int | None = None,
                   logits_dtype: torch.dtype | None = None, q_scale: torch.Tensor | None = None,
                   _checked: bool = False) -> torch.Tensor:
    """``out[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])`` for ``ks[m] <= n < ke[m]``.

    With ``max_seqlen_k`` the logits are *compressed* (docs/spec.md §5): ``out`` is ``[M, max_seqlen_k]`` and
    ``out[m, j]`` holds the score of key ``ks[m] + j`` for ``j < ke[m] - ks[m]`` (each row's window from column
    0; DeepGEMM's ``max_seqlen_k``). Cells past a row's window are ``-inf`` with ``clean=True``, else undefined.

    Args:
        q: ``[M, H, D]`` fp8 (e4m3fn or e4m3fnuz) queries, their scale folded into ``weights``.
        k_fp8: ``[N, D]`` fp8 keys, usually in ``q``'s format; another FP8 format is an explicit mix (the
            tensors carry their formats), each operand read exactly in its own (e4m3fnuz queries against the
            e4m3fn keys of a DeepSeek-V4 cache on gfx942): only the reference backend computes a mix (the others
            raise ``NotImplementedError``, so ``auto`` runs the reference).
        k_scale: ``[N]`` float32 key scales.
        weights: ``[M, H]`` float32 (signed) head weights.
        cu_seqlen_ks: ``[M]`` int32, first key of each query's window (``ks``; DeepGEMM's name: per-query
            window bounds, not cumulative sums, unlike ``gather_k_cache``'s ``cu_seq_lens``).
        cu_seqlen_ke: ``[M]`` int32, one past the last key (``ke <= N``; ``ke <= ks`` is an empty window).
        out: ``[M, N]`` (``[M, max_seqlen_k]`` compressed) float32 or bfloat16 (unit stride in the last dim),
            written in place in its dtype (bfloat16: each float32 score rounded to nearest even); allocated
            when ``None`` (dtype ``logits_dtype``, default float32).
        clean: ``True`` writes ``-inf`` outside every window; ``False`` leaves those cells undefined.
        backend: ``None``/``"auto"`` (the best backend available on the device; the next one when it raises
            ``NotImplementedError`` for the case) or a backend's name (``sparse_indexer.backends.names()``).
        check_values: check the windows against ``N`` (reads device values: a sync on a GPU); default: on the
            CPU only (compressed: also ``ke - ks <= max_seqlen_k``).
        max_seqlen_k: ``None`` (full ``[M, N]`` logits) or the compressed width, ``>= max(ke - ks)``.
        logits_dtype: dtype of an allocated ``out`` (float32 or bfloat16); must match ``out`` when both given.
        q_scale: MXFP4 operands (docs/spec.md §3a) when given: ``q [M, H, D / 2]`` uint8 packed e2m1 values,
            ``q_scale [M, H, D / 32]`` uint8 their scale bytes (the query keeps its scales: ``weights`` are
            ``w * D**-0.5 * H**-0.5``), ``k_fp8 [N, D / 2]`` and ``k_scale [N, D / 32]`` uint8 the keys'
            (:func:`sparse_indexer.quantize_q_mxfp4`, :func:`~sparse_indexer.quantize_k_mxfp4`); the score is
            the §3a one. The reference and Triton backends score MXFP4 (Gluon and aiter raise
            ``NotImplementedError``, so ``auto`` takes the next).

    Returns:
        ``out``.

    ``_checked=True`` is for :func:`sparse_indexer.sparse_attn_indexer` alone (see
    :func:`sparse_indexer.top_k_per_row`).
    """
    if q_scale is not None:
        return _mxfp4(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean, backend, check_values,
                      max_seqlen_k, logits_dtype, q_scale)
    if _checked:
        if max_seqlen_k is None:
            library.call("fp8_mqa_logits", backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks,
                         cu_seqlen_ke, out=out, clean=bool(clean))
        else:
            library.call("fp8_mqa_logits", backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks,
                         cu_seqlen_ke, out=out, clean=bool(clean), compressed=True)
        return out
    ts = (out, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke)  # (outputs first: _checks.Layouts)
    if out is not None and (max_seqlen_k is None or type(max_seqlen_k) is int) and _plain_eager():
        proven, facts = _LAYOUTS.match(ts, (max_seqlen_k, logits_dtype))
        if proven:  # the layout of a call that passed every check below: only aliasing (matched) and values
            dev, n, cpu, memo = facts
            if C.values_wanted(check_values, cpu):
                check_ragged_windows(cu_seqlen_ks, cu_seqlen_ke, n, max_seqlen_k)
            _run("fp8_mqa_logits", backend, dev, (q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke),
                 {"out": out, "clean": bool(clean)} if max_seqlen_k is None else
                 {"out": out, "clean": bool(clean), "compressed": True}, (out,), memo)
            return out
    m, n, dev = check_ragged_inputs(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke)
    out, given = _checked_out(out, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, m, n, dev, max_seqlen_k,
                              logits_dtype, check_values)
    if given and library.runs_directly(dev, ts):
        _LAYOUTS.remember(ts, 1, (max_seqlen_k, logits_dtype), (dev, n, dev.type == "cpu", {}))
    if max_seqlen_k is None:
        library.call("fp8_mqa_logits", backend, dev, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
                     out=out, clean=bool(clean))
    else:
        library.call("fp8_mqa_logits", backend, dev, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
                     out=out, clean=bool(clean), compressed=True)
    return out


def _checked_out(out, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, m, n, dev, max_seqlen_k,
                 logits_dtype, check_values, q_scale=None):
    """The checks of ``max_seqlen_k``, ``logits_dtype``, ``out`` (allocated when ``None``) and the windows'
    values; returns ``(out, whether it was given)``."""
    if max_seqlen_k is not None:
        if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
            raise ValueError(f"max_seqlen_k must be None or an int >= 0, got {max_seqlen_k!r}")
    width = n if max_seqlen_k is None else max_seqlen_k
    if logits_dtype is not None and logits_dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype}")
    given = out is not None
    if out is None:
        out = torch.empty(m, width, dtype=logits_dtype or torch.float32, device=dev)
    else:
        C.tensor("out", out, dtypes=LOGITS_DTYPES if logits_dtype is None else logits_dtype, device=dev,
                 shape=(m, width), last_contiguous=True)
        C.no_alias("out", out, q=q, k_fp8=k_fp8, k_scale=k_scale, weights=weights, cu_seqlen_ks=cu_seqlen_ks,
                   cu_seqlen_ke=cu_seqlen_ke, **({} if q_scale is None else {"q_scale": q_scale}))
    if C.want_value_checks(check_values, cu_seqlen_ks, cu_seqlen_ke):
        check_ragged_windows(cu_seqlen_ks, cu_seqlen_ke, n, max_seqlen_k)
    return out, given


def check_ragged_mxfp4_inputs(q: torch.Tensor, q_scale: torch.Tensor, k_vals: torch.Tensor, k_scales: torch.Tensor,
                              weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                              cu_seqlen_ke: torch.Tensor) -> tuple[int, int, torch.device]:
    """Check the MXFP4 operands of a ragged call (docs/spec.md §3a): ``q [M, H, D / 2]`` and ``q_scale [M, H,
    D / 32]`` uint8, ``k_vals [N, D / 2]`` and ``k_scales [N, D / 32]`` uint8 (``D`` a positive multiple of 32),
    all contiguous, ``weights [M, H]`` float32, the windows ``[M]`` int32, one device. Returns ``(M, N,
    device)``."""
    C.tensor("q", q, ndim=3, dtypes=torch.uint8, contiguous=True)
    m, h, half = q.shape
    dev = q.device
    if half == 0 or half % 16:
        raise ValueError(f"MXFP4 q must be [M, H, D / 2] with D a positive multiple of 32, got {list(q.shape)}")
    C.tensor("q_scale", q_scale, dtypes=torch.uint8, device=dev, shape=(m, h, half // 16), contiguous=True)
    C.tensor("k_fp8", k_vals, ndim=2, dtypes=torch.uint8, device=dev, shape=(None, half), contiguous=True)
    n = k_vals.shape[0]
    C.tensor("k_scale", k_scales, dtypes=torch.uint8, device=dev, shape=(n, half // 16), contiguous=True)
    C.tensor("weights", weights, dtypes=torch.float32, device=dev, shape=(m, h), last_contiguous=True)
    C.tensor("cu_seqlen_ks", cu_seqlen_ks, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,), contiguous=True)
    C.tensor("cu_seqlen_ke", cu_seqlen_ke, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,), contiguous=True)
    return m, n, dev


def _mxfp4(q, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean, backend, check_values,
           max_seqlen_k, logits_dtype, q_scale) -> torch.Tensor:
    """:func:`fp8_mqa_logits` with MXFP4 operands: every check, then the op with ``q_scale``."""
    m, n, dev = check_ragged_mxfp4_inputs(q, q_scale, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke)
    out, _ = _checked_out(out, q, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke, m, n, dev, max_seqlen_k,
                          logits_dtype, check_values, q_scale)
    kw = {"out": out, "clean": bool(clean), "q_scale": q_scale}
    if max_seqlen_k is not None:
        kw["compressed"] = True
    library.call("fp8_mqa_logits", backend, dev, q, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke, **kw)
    return out


_LAYOUTS = C.Layouts()  # the last fully checked call's layout (host overhead per call)
_plain_eager = library.plain_eager
_run = library.run_direct


def check_ragged_windows(cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, n: int,
                         max_seqlen_k: int | None = None) -> None:
    """The value checks of a ragged call (``check_values``; reads values): every non-empty window inside
    ``[0, n)``, and with ``max_seqlen_k`` at most that long."""
    nonempty = lambda: cu_seqlen_ke > cu_seqlen_ks  # noqa: E731 - built only when a value is out of range
    C.values_in("cu_seqlen_ks", cu_seqlen_ks, 0, None, "window starts must be >= 0", mask=nonempty)
    C.values_in("cu_seqlen_ke", cu_seqlen_ke, None, n + 1, lambda: f"window ends must be <= N = {n}",
                mask=nonempty)
    if max_seqlen_k is not None and cu_seqlen_ks.shape[0]:
        lens = cu_seqlen_ke.long() - cu_seqlen_ks.long()
        C.values_in("cu_seqlen_ke - cu_seqlen_ks", lens, None, max_seqlen_k + 1,
                    lambda: f"windows must be at most max_seqlen_k = {max_seqlen_k} keys long")

