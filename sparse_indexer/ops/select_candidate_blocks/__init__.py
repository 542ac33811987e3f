"""``select_candidate_blocks``: the candidate blocks a source indexer layer publishes per row (docs/spec.md §6a).

DeepSeek-V4.1's two-level indexer: one *source* layer scores the whole window, keeps its own top-k and publishes,
for every row, the ``K_b`` blocks of ``b`` consecutive positions with the largest logits (the newest block always
among them); later *consumer* layers select their top-k inside those blocks only
(:func:`sparse_indexer.top_k_per_row` with ``candidates=``).
"""

from __future__ import annotations

import torch

from buffers import BufferTooSmall

from ..._runtime import checks as C
from ..._runtime import library
from ..top_k_per_row import block_size_arg, check_rows, check_windows

__all__ = ["select_candidate_blocks", "num_blocks"]


def num_blocks(width: int, block_size: int) -> int:
    """Blocks of ``block_size`` positions that cover ``width`` logits columns: ``ceil(width / block_size)``."""
    return -(-width // block_size)


def select_candidate_blocks(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor, *,
                            out: torch.Tensor, block_size: int, backend: str | None = None,
                            check_values: bool | None = None, workspace: torch.Tensor | None = None,
                            _checked: bool = False) -> torch.Tensor:
    """Per row, the ids of the ``K_b = out.shape[1]`` blocks of ``block_size`` positions with the largest logits.

    Row ``r``'s window is ``[s, e) = [row_starts[r], row_ends[r])``; block ``j`` (an id relative to ``s``) covers
    ``[s + j*b, s + (j+1)*b)`` clipped to the window. Its score is the NaN-propagating maximum of its cells; the
    newest block (the one holding ``e - 1``) ranks above every other; a block holding a NaN ranks below every
    finite score; a block whose cells are all ``-inf`` is never a candidate. The row holds the ids of the
    ``min(K_b, candidates)`` best blocks first, in any order (ties broken either way), then -1. Cells outside the
    window are never read (``clean=False`` logits are fine).

    Args:
        logits: ``[R, W]`` float32 or bfloat16 (unit last stride): the source layer's logits.
        row_starts, row_ends: ``[R]`` int32 windows (``row_ends <= W`` for non-empty rows), as for
            :func:`sparse_indexer.top_k_per_row`.
        out: ``[R, K_b]`` int32, written in place.
        block_size: ``b``, positions per block (DeepSeek-V4.1: 8).
        backend: ``None``/``"auto"`` or a backend's name.
        check_values: check the windows against ``W`` (a sync on a GPU); default: on the CPU only. Unchecked
            windows are clamped (``row_starts >= 0``, ``row_ends <= W``; docs/spec.md §10).
        workspace: optional ``[>= R, >= ceil(W / b)]`` int32 scratch for the block scores (a
            :meth:`Buffers.block_scores_view`); the Triton backend needs it and allocates one when it is not given
            (the step always passes one). Contents afterwards undefined.

    Raises:
        BufferTooSmall: ``workspace`` is smaller than ``[R, ceil(W / b)]``.

    Returns:
        ``out``.
    """
    if _checked:
        _call(logits, row_starts, row_ends, out, block_size, backend, workspace)
        return out
    r, w, dev = check_rows(logits, row_starts, row_ends, out, "candidate blocks K_b")
    b = block_size_arg(block_size)
    C.no_alias("out", out, logits=logits, row_starts=row_starts, row_ends=row_ends)
    if workspace is not None:
        C.tensor("workspace", workspace, ndim=2, dtypes=torch.int32, device=dev, last_contiguous=True)
        need = num_blocks(w, b)
        if workspace.shape[0] < r or workspace.shape[1] < need:
            raise BufferTooSmall("workspace", r * need, workspace.numel(),
                                 f"block scores of shape {tuple(workspace.shape)}: needs >= [{r}, {need}] int32")
        C.no_alias("workspace", workspace, logits=logits, row_starts=row_starts, row_ends=row_ends, candidates=out)
    if C.want_value_checks(check_values, row_starts, row_ends):
        check_windows(row_starts, row_ends, w)
    _call(logits, row_starts, row_ends, out, b, backend, workspace)
    return out


def _call(logits, row_starts, row_ends, out, block_size, backend, workspace) -> None:
    if workspace is None:
        library.call("select_candidate_blocks", backend, logits.device, logits, row_starts, row_ends, out=out,
                     block_size=block_size)
    else:
        library.call("select_candidate_blocks", backend, logits.device, logits, row_starts, row_ends, out=out,
                     block_size=block_size, workspace=workspace)
