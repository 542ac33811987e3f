"""Programmatic dependent launch (PDL, NVIDIA sm_90+) between a step's kernels.

A kernel launched with the programmatic-stream-serialization attribute (the CUDA top-k: ``ops/top_k_per_row``)
may be scheduled before the previous kernel on its stream has finished; it waits (``griddepcontrol.wait``) for
that kernel's completion and the visibility of its writes before it touches memory, so it is correct after any
kernel. By default it is scheduled once every CTA of the previous kernel has exited, which hides the launch
latency between the two. A previous kernel that *signals* its dependents (``griddepcontrol.launch_dependents``,
here at the start of the paged logits kernels) lets them be scheduled earlier, on each SM as soon as that SM's
own CTAs of the previous kernel leave it: the dependent's CTA launch and its set-up overlap the previous kernel's
tail. The signal only changes scheduling, never what the dependent reads.

The paged logits kernels are dependents in turn (of whatever kernel the engine ran before them, the cache write
of the step included): launched with Triton's ``launch_pdl`` option, they wait (``griddepcontrol.wait``) at
their start.

:func:`signals` and :func:`depends` say whether a Triton or Gluon kernel compiled for ``device`` signals its
dependents, and whether it is launched as a dependent (constexprs of the kernel): CUDA devices of compute
capability 9 or newer, not Triton's CPU interpreter, and :data:`SIGNAL` / :data:`DEPEND` set.
"""

from __future__ import annotations

import functools

import torch

from .triton_compat import interpreting

__all__ = ["DEPEND", "SIGNAL", "depends", "launch_dependents", "signals", "wait_for_predecessor"]

try:  # Triton's builtins for griddepcontrol.launch_dependents and griddepcontrol.wait (Triton >= 3.3)
    from triton.language.extra.cuda import gdc_launch_dependents as launch_dependents
    from triton.language.extra.cuda import gdc_wait as wait_for_predecessor
except ImportError:  # pragma: no cover - an older Triton or none: no kernel signals or waits
    launch_dependents = wait_for_predecessor = None

SIGNAL = True
"""Whether the paged logits kernels signal their dependents (read when a kernel's launch plan is made)."""
DEPEND = True
"""Whether the paged logits kernels are launched as dependents of their predecessor (read likewise)."""


@functools.cache
def _launch_option() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - no NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def signals(device: torch.device) -> bool:
    """Whether a kernel compiled for ``device`` signals its programmatic dependents (see the module doc)."""
    if not SIGNAL or launch_dependents is None or device.type != "cuda" or interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def depends(device: torch.device) -> bool:
    """Whether a kernel compiled for ``device`` is launched as a programmatic dependent (``launch_pdl=True``) and
    waits for its predecessor at its start (see the module doc)."""
    if not DEPEND or wait_for_predecessor is None or not _launch_option() or device.type != "cuda" or interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())
