"""Host TMA descriptors of the Gluon kernels, made once per (pointer, dtype, shape, strides, box, layout).

A Gluon kernel that reads through TMA takes host ``TensorDescriptor`` objects. Building one per call costs
its validation (``__post_init__``), and Triton 3.6's launcher encodes it into a ``CUtensorMap`` on every launch
(``cuTensorMapEncodeTiled`` through ``make_tensordesc_arg``). :class:`Descriptors` keeps each descriptor, and
:class:`sparse_indexer._runtime.launch.Launcher` keeps each one's encoded map on the descriptor object itself, so a
repeated call (the same cache, query and output buffers every step) builds and encodes nothing.

An entry holds no tensor (the base is a :class:`Ptr`: a data pointer and a dtype, what a descriptor reads of
its base): a cached descriptor never keeps a multi-GB cache alive. A map is an address with a shape, valid for
whatever tensor later sits at that address with that shape. The cache is bounded (cleared when full).
"""

from __future__ import annotations

import torch

__all__ = ["Descriptors", "Ptr"]


class Ptr:
    """What a host ``TensorDescriptor`` reads of its base tensor (a data pointer and a dtype), without keeping the
    tensor alive."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr


class Descriptors:
    """A bounded cache of host ``TensorDescriptor`` objects (one per kernel wrapper). ``get`` returns the same
    object for the same arguments, which the bound launch needs to reuse its encoded map."""

    __slots__ = ("_cls", "_cache", "_max")

    def __init__(self, descriptor_class, max_entries: int = 64):
        self._cls = descriptor_class
        self._cache: dict = {}
        self._max = max_entries

    def get(self, ptr: int, dtype: torch.dtype, shape: tuple, strides: tuple, block: tuple, layout):
        """The descriptor of the ``shape``/``strides`` (elements) view at ``ptr``, read in ``block`` boxes into
        shared memory of ``layout``. Tuples of ints; ``ptr`` 16-byte aligned (the descriptor checks it)."""
        key = (ptr, dtype, shape, strides, block, layout)
        d = self._cache.get(key)
        if d is None:
            if len(self._cache) >= self._max:
                self._cache.clear()
            d = self._cache[key] = self._cls(Ptr(ptr, dtype), list(shape), list(strides), list(block), layout)
        return d

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
