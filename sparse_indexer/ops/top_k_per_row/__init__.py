"""``top_k_per_row``: the ``topk`` best key positions of every row's window (docs/spec.md §6)."""

from __future__ import annotations

import torch

from buffers import BufferTooSmall

from ..._runtime import checks as C
from ..._runtime import library
from .workspace import COUNTERS as TOPK_SCRATCH_COUNTERS

__all__ = ["top_k_per_row"]


LOGITS_DTYPES = (torch.float32, torch.bfloat16)
"""Logits dtypes ``top_k_per_row`` reads (bfloat16 logits halve the logits traffic)."""

MIN_WORKSPACE_COLS = TOPK_SCRATCH_COUNTERS + 2
"""Narrowest workspace row: the counters and one candidate (narrow rows stay exact, through a slower path)."""


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor, *, out: torch.Tensor,
                  backend: str | None = None, check_values: bool | None = None,
                  workspace: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                  candidate_block_size: int | None = None, _checked: bool = False) -> torch.Tensor:
    """Select, per row, the positions of the ``topk = out.shape[1]`` largest logits of its window.

    Row ``r``'s window is ``[row_starts[r], row_ends[r])`` (``len`` clamped at 0). When ``len <= topk`` the row
    is ``0, 1, ..., len - 1, -1, ...``; otherwise it holds the ``topk`` positions (relative to ``row_starts[r]``,
    in any order) whose logits are the largest, ties broken either way; ``-inf`` and NaN rank below every
    finite value. Cells outside the window are never read, so ``clean=False`` logits are fine.

    Args:
        logits: ``[R, W]`` float32 or bfloat16 (unit last stride). The selection is exact on the values given:
            bfloat16 rounding makes more ties, which may go either way like any other tie. Compressed rows (each
            window starting at column 0, e.g. ``fp8_mqa_logits(..., max_seqlen_k=...)``) are windows
            ``[0, len)``: pass ``row_starts`` all 0, no copy needed.
        row_starts: ``[R]`` int32.
        row_ends: ``[R]`` int32, ``<= W`` for non-empty rows.
        out: ``[R, topk]`` int32, written in place.
        backend: ``None``/``"auto"`` (the best backend available on the device; the next one when it raises
            ``NotImplementedError`` for the case) or a backend's name (``sparse_indexer.backends.names()``).
        check_values: check the windows against ``W`` (reads device values: a sync on a GPU); default: on the
            CPU only. Unchecked windows are clamped (``row_starts >= 0``, ``row_ends <= W``; docs/spec.md §10).
        workspace: optional ``[>= R, C]`` int32 scratch (unit last stride, ``C >= 34``; a
            :meth:`Buffers.topk_scratch_view`) for backends that split rows over several programs (Triton, when
            ``R`` is below twice the SM count): per row 32 counters, then positions and values of up to
            ``(C - 32) // 2`` candidates. The other backends ignore it; its contents afterwards are undefined.
        candidates: optional ``[R, K_b]`` int32 candidate block ids (docs/spec.md §6a; what
            :func:`sparse_indexer.select_candidate_blocks` writes): only the window cells inside a candidate block
            (``[s + j*b, s + (j+1)*b)`` for each id ``j >= 0``, ``b = candidate_block_size``) are eligible. A
            row with at most ``topk`` eligible cells gets all of their positions, then -1; otherwise the
            ``topk`` largest eligible ones. Only those cells are read and the logits are left as they are. Ids
            past the window select nothing; an id named twice in a row is an error (checked with the values).
        candidate_block_size: ``b``, positions per candidate block (required with ``candidates``).

    Raises:
        BufferTooSmall: ``workspace`` has fewer than ``R`` rows or fewer than 34 columns.

    Returns:
        ``out``.

    ``_checked=True`` is for :func:`sparse_indexer.sparse_attn_indexer` alone, which proved every argument in
    :func:`~sparse_indexer.indexer.check_step` and its metadata in :func:`~sparse_indexer.build_metadata`.
    """
    if candidates is not None:
        _candidate_call(logits, row_starts, row_ends, out, backend, check_values, candidates, candidate_block_size,
                        _checked)
        return out
    if candidate_block_size is not None:
        raise ValueError("candidate_block_size is given without candidates")
    if _checked:
        if workspace is None:
            library.call("top_k_per_row", backend, logits.device, logits, row_starts, row_ends, out=out)
        else:
            library.call("top_k_per_row", backend, logits.device, logits, row_starts, row_ends, out=out,
                         workspace=workspace)
        return out
    # (outputs first, a fixed arity: _checks.Layouts)
    ts = (out, workspace, logits, row_starts, row_ends)
    if _plain_eager():
        proven, facts = _LAYOUTS.match(ts)
        if proven:  # the layout of a call that passed every check below: only aliasing (matched) and values
            dev, w, cpu, memo = facts
            if C.values_wanted(check_values, cpu):
                check_windows(row_starts, row_ends, w)
            _run("top_k_per_row", backend, dev, (logits, row_starts, row_ends),
                 {"out": out} if workspace is None else {"out": out, "workspace": workspace},
                 (out,) if workspace is None else (out, workspace), memo)
            return out
    r, w, dev = check_rows(logits, row_starts, row_ends, out, "topk")
    C.no_alias("out", out, logits=logits, row_starts=row_starts, row_ends=row_ends)
    if C.want_value_checks(check_values, row_starts, row_ends):
        check_windows(row_starts, row_ends, w)
    if workspace is not None:
        C.tensor("workspace", workspace, ndim=2, dtypes=torch.int32, device=dev, last_contiguous=True)
        rows, cols = workspace.shape
        if rows < r or cols < MIN_WORKSPACE_COLS:
            raise BufferTooSmall("workspace", r * max(cols, MIN_WORKSPACE_COLS), workspace.numel(),
                                 f"top-k workspace of shape {tuple(workspace.shape)}: needs >= {r} rows of "
                                 f">= {MIN_WORKSPACE_COLS} int32")
        C.no_alias("workspace", workspace, logits=logits, row_starts=row_starts, row_ends=row_ends, topk_out=out)
    if library.runs_directly(dev, ts):
        _LAYOUTS.remember(ts, 2, extra=(dev, w, dev.type == "cpu", {}))
    if workspace is None:
        library.call("top_k_per_row", backend, dev, logits, row_starts, row_ends, out=out)
    else:
        library.call("top_k_per_row", backend, dev, logits, row_starts, row_ends, out=out, workspace=workspace)
    return out


_LAYOUTS = C.Layouts()  # the last fully checked call's layout (host overhead per call)
_plain_eager = library.plain_eager
_run = library.run_direct


def _candidate_call(logits, row_starts, row_ends, out, backend, check_values, candidates, block_size,
                    checked: bool) -> None:
    """A candidate-restricted top-k (no workspace: its backends need none)."""
    if not checked:
        r, w, dev = check_rows(logits, row_starts, row_ends, out, "topk")
        block_size = check_candidates(candidates, r, dev, block_size, check_values)
        C.no_alias("out", out, logits=logits, row_starts=row_starts, row_ends=row_ends, candidates=candidates)
        if C.want_value_checks(check_values, row_starts, row_ends):
            check_windows(row_starts, row_ends, w)
    library.call("top_k_per_row", backend, logits.device, logits, row_starts, row_ends, out=out,
                 candidates=candidates, candidate_block_size=block_size)


def check_rows(logits, row_starts, row_ends, out, cols: str) -> tuple[int, int, torch.device]:
    """The row arguments of a per-row selection: ``logits [R, W]`` float32/bfloat16 (unit last stride),
    ``row_starts``/``row_ends [R]`` int32 on its device, ``out [R, >= 1]`` int32 (``cols``: what its columns
    count, for the message). Returns ``(R, W, device)``."""
    C.tensor("logits", logits, ndim=2, dtypes=LOGITS_DTYPES, last_contiguous=True)
    r, w = logits.shape
    dev = logits.device
    C.tensor("row_starts", row_starts, dtypes=C.INDEX_DTYPES, device=dev, shape=(r,), contiguous=True)
    C.tensor("row_ends", row_ends, dtypes=C.INDEX_DTYPES, device=dev, shape=(r,), contiguous=True)
    C.tensor("out", out, ndim=2, dtypes=torch.int32, device=dev, shape=(r, None), last_contiguous=True)
    if out.shape[1] < 1:
        raise ValueError(f"out.shape[1] ({cols}) must be >= 1, got {out.shape[1]}")
    return r, w, dev


def block_size_arg(block_size) -> int:
    """``block_size`` checked: an int >= 1 (positions per candidate block)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    return block_size


def check_candidates(candidates: torch.Tensor, rows: int, device: torch.device, block_size,
                     check_values: bool | None = None) -> int:
    """Check the ``candidates=`` of a candidate-restricted top-k: ``[rows, K_b]`` int32 (unit last stride) on
    ``device``, ``block_size`` an int >= 1; with value checks (default on the CPU), ids >= -1 and no id twice in
    a row (-1 apart). Returns ``block_size``."""
    C.tensor("candidates", candidates, ndim=2, dtypes=torch.int32, device=device, shape=(rows, None),
             last_contiguous=True)
    if candidates.shape[1] < 1:
        raise ValueError(f"candidates must have >= 1 column (K_b), got shape {tuple(candidates.shape)}")
    b = block_size_arg(block_size)
    if C.want_value_checks(check_values, candidates) and candidates.numel():
        C.values_in("candidates", candidates, -1, None, "candidate block ids must be >= 0 (or -1 for none)")
        srt = candidates.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            row = int(dup.any(dim=1).nonzero()[0])
            raise ValueError(f"candidates row {row} names a block twice: ids must be distinct (-1 apart)")
    return b


def check_windows(row_starts: torch.Tensor, row_ends: torch.Tensor, w: int) -> None:
    """The windows' values: starts >= 0 and ends <= ``w`` where a window is not empty (reads the values)."""
    nonempty = lambda: row_ends > row_starts  # noqa: E731 - built only when a value is out of range
    C.values_in("row_starts", row_starts, 0, None, "window starts must be >= 0", mask=nonempty)
    C.values_in("row_ends", row_ends, None, w + 1, lambda: f"window ends must be <= W = {w}", mask=nonempty)
