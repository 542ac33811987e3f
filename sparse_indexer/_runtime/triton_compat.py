"""Work-arounds for the range of Triton releases this package supports (``pyproject.toml``: 3.6.0 to the newest).

Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) stores every scalar as a one-element NumPy array and turns
it into a Python ``int`` with ``int(array)`` whenever a kernel uses a scalar as a Python index, e.g. the bounds
of ``for t in range(lo, hi)`` or an integer kernel argument ``N`` in ``range(0, N, BLOCK)``. NumPy 2.4 made
``int()`` of an array with ``ndim > 0`` a ``TypeError`` ("only 0-dimensional arrays can be converted to Python
scalars"), so under Triton 3.6 with NumPy >= 2.4 every kernel with a runtime loop bound fails in the interpreter.
Triton fixed this upstream (triton-lang/triton#9171); compiled GPU kernels never take this path.

:func:`fix_interpreter` makes the interpreter take the scalar's single element instead. It changes nothing
unless Triton runs in interpreter mode and the installed interpreter shows the failure (a probe, not a version
check), and applying it twice is harmless. Every ``sparse_indexer/ops/*/triton.py`` calls it at import.
"""

from __future__ import annotations

import operator
import os

__all__ = ["fix_interpreter", "interpreter_needs_fix", "interpreting"]

_MARK = "_sparse_indexer_index_fix"


def interpreting() -> bool:
    """``TRITON_INTERPRET`` is set (Triton then runs its kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _scalar_index(self) -> int:
    """``__index__`` of an interpreted scalar: its one element (the handle is a 1-element array)."""
    return int(self.handle.data.reshape(-1)[0])


def interpreter_needs_fix() -> bool:
    """True when the installed Triton interpreter cannot use a scalar as a Python index (Triton 3.6, NumPy 2.4)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except Exception:  # noqa: BLE001 - no interpreter, nothing to fix
        return False
    if getattr(interp._patch_lang_tensor, _MARK, False):
        return False
    try:
        scope = interp._LangPatchScope()
        interp._patch_lang_tensor(tl.tensor, scope)
        try:
            operator.index(tl.tensor(interp.TensorHandle(np.array([3], dtype=np.int32), tl.int32), tl.int32))
        finally:
            scope.restore()
    except TypeError:
        return True
    except Exception:  # noqa: BLE001 - a different interpreter layout: leave it alone
        return False
    return False


def fix_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1``, let interpreted scalars serve as Python indices when the interpreter cannot."""
    if not interpreting() or not interpreter_needs_fix():
        return
    from triton.runtime import interpreter as interp

    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)  # restored with the rest of the scope

    setattr(patch_lang_tensor, _MARK, True)
    interp._patch_lang_tensor = patch_lang_tensor
