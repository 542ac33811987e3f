"""Argument checks shared by the public entry points. Every check runs before anything is written."""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPES

INDEX_DTYPES = (torch.int32,)


def tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None, shape=None,
           last_contiguous: bool = False, contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``shape`` may hold ``None`` wildcards. Returns ``t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        if t.dtype not in dtypes:
            want = dtypes[0] if len(dtypes) == 1 else dtypes
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of the other inputs)")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    return t


def fp8(name: str, t, **kw) -> torch.Tensor:
    return tensor(name, t, dtypes=FP8_DTYPES, **kw)


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    extent = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def no_alias(out_name: str, out: torch.Tensor, **inputs) -> None:
    """Raise if ``out``'s bytes overlap any input's bytes (byte ranges, so disjoint views of one arena pass)."""
    if out.device.type == "meta" or is_traced(out):
        return
    o0, o1 = _span(out)
    if o0 == o1:
        return
    for name, t in inputs.items():
        if t is None or t.device != out.device:
            continue
        i0, i1 = _span(t)
        if i0 < o1 and o0 < i1:
            raise ValueError(f"{out_name} overlaps the memory of input {name}; outputs must not alias inputs")


def is_traced(t: torch.Tensor) -> bool:
    """True for fake, meta, functional or functorch-wrapped tensors, and while Dynamo traces."""
    if torch.compiler.is_compiling():
        return True
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return True
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    return torch._is_functional_tensor(t) if hasattr(torch, "_is_functional_tensor") else False


def want_value_checks(check_values: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether to run checks that read tensor *values* (they synchronise with the device).

    ``None`` (the default) checks when every tensor is a plain CPU tensor: free there, and a GPU caller that
    builds its metadata on the host (as :func:`sparse_indexer.sparse_attn_indexer` does) has checked it already.
    ``True`` forces the checks (one device sync), ``False`` skips them.
    """
    if any(t is not None and is_traced(t) for t in tensors):
        return False
    if check_values is None:
        return all(t is None or t.device.type == "cpu" for t in tensors)
    return bool(check_values)


def values_in(name: str, t: torch.Tensor, lo: int | None, hi: int | None, what: str, mask=None) -> None:
    """Raise unless ``lo <= t < hi`` for every element (where ``mask``); names the first offender."""
    bad = torch.zeros_like(t, dtype=torch.bool)
    if lo is not None:
        bad |= t < lo
    if hi is not None:
        bad |= t >= hi
    if mask is not None:
        bad &= mask
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        where = idx[0] if len(idx) == 1 else list(idx)
        v = int(t[idx])
        rng = f"is >= {hi}" if lo is None else f"is < {lo}" if hi is None else f"is outside [{lo}, {hi})"
        raise ValueError(f"{name}[{where}] = {v} {rng}: {what}")
