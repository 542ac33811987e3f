"""What the aiter backends of every op share: the GPU architecture, the FP8 format its matrix cores read, aiter's
Triton modules, and the preshuffled K-cache layout the aiter ops agree on (docs/spec.md §4; the layout is
described in :mod:`sparse_indexer.ops.write_k_cache.aiter`). aiter itself is imported lazily.
"""

from __future__ import annotations

import importlib

import torch

from ..kcache import block_bytes, preshuffled_offsets

__all__ = ["NATIVE_FP8", "aiter_triton_module", "gcn_arch", "native_fp8", "preshuffle_offsets", "preshuffled",
           "raw_blocks"]

NATIVE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
"""The FP8 format aiter's gfx9 kernels read, per architecture."""


def aiter_triton_module(name: str):
    """aiter's Triton module ``name`` (``aiter.ops.triton.attention.<name>``, or the older
    ``aiter.ops.triton.<name>``); ``NotImplementedError`` when neither imports, so auto falls back."""
    for path in (f"aiter.ops.triton.attention.{name}", f"aiter.ops.triton.{name}"):
        try:
            return importlib.import_module(path)
        except ImportError:
            continue
    raise NotImplementedError(f"aiter has no {name} module (aiter.ops.triton[.attention].{name})")


def gcn_arch(device: torch.device) -> str | None:
    """``"gfx942"``, ``"gfx950"``, ... for a ROCm device; ``None`` elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is None:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def preshuffled(block_size: int, fp8_dtype: torch.dtype, arch: str | None) -> bool:
    """Whether the aiter backend keeps a cache of this block size and format preshuffled on ``arch``."""
    return arch in NATIVE_FP8 and NATIVE_FP8[arch] == fp8_dtype and block_size % 16 == 0


preshuffle_offsets = preshuffled_offsets
"""``[block_size, head_dim]`` int64: byte offset of value (t, d) inside a preshuffled block (docs/spec.md §4;
:func:`sparse_indexer.kcache.preshuffled_offsets`)."""


def raw_blocks(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[nb, block_size * (D + 4)]`` uint8 bytes of every block, ``[nb, block_size]`` float32 scales) of a
    3-D cache view; works for padded block strides."""
    raw, lay = block_bytes(kv_cache)
    return raw, raw[:, lay.block_size * lay.head_dim :].view(torch.float32)


def native_fp8(device: torch.device) -> torch.dtype:
    """The FP8 format of ``device``'s matrix cores: ``float8_e4m3fnuz`` on gfx94x (MI300), ``float8_e4m3fn``
    elsewhere (NVIDIA, gfx950, the CPU; docs/spec.md §2)."""
    return torch.float8_e4m3fnuz if (gcn_arch(device) or "").startswith("gfx94") else torch.float8_e4m3fn
