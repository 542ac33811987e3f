"""aiter and ``select_candidate_blocks``: aiter computes block maxima only inside its own MXFP4 logits kernels
(vLLM's ROCm V4.1 path), not as an op over given logits, so this backend takes no call: ``auto`` runs the next
backend (Triton on ROCm)."""

from __future__ import annotations


def select_candidate_blocks(logits, row_starts, row_ends, *, out, block_size) -> None:
    """Raises ``NotImplementedError`` before writing anything (see the module docstring)."""
    raise NotImplementedError("aiter has no candidate-block selection over given logits; the Triton backend has")
