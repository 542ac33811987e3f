"""What the aiter backends of every op share: the GPU architecture, the FP8 format its matrix cores read, aiter's
Triton modules, and the preshuffled K-cache layout the aiter ops agree on (docs/spec.md §4; the layout is
described in :mod:`sparse_indexer.ops.write_k_cache.aiter`). aiter itself is imported lazily.
"""

from __future__ import annotations

import importlib

import torch

from ..kcache import cache_layout

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


def preshuffle_offsets(block_size: int, head_dim: int, device=None) -> torch.Tensor:
    """``[block_size, head_dim]`` int64: byte offset of value (t, d) inside a preshuffled block (docs/spec.md §4)."""
    if block_size % 16 or head_dim % 16:
        raise ValueError(f"preshuffling needs block_size and head_dim multiples of 16, got {block_size}, {head_dim}")
    t = torch.arange(block_size, device=device)[:, None]
    d = torch.arange(head_dim, device=device)[None, :]
    return (t // 16) * 16 * head_dim + (d // 16) * 256 + (t % 16) * 16 + d % 16


def raw_blocks(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[nb, block_size * (D + 4)]`` uint8 bytes of every block, ``[nb, block_size]`` float32 scales) of a
    3-D cache view; works for padded block strides."""
    lay = cache_layout(kv_cache)
    nb, bs, d = lay.num_blocks, lay.block_size, lay.head_dim
    raw = kv_cache.as_strided((nb, bs * (d + 4)), (lay.block_stride, 1), kv_cache.storage_offset())
    return raw, raw[:, bs * d :].view(torch.float32)


def native_fp8(device: torch.device) -> torch.dtype:
    """The FP8 format of ``device``'s matrix cores: ``float8_e4m3fnuz`` on gfx94x (MI300), ``float8_e4m3fn``
    elsewhere (NVIDIA, gfx950, the CPU; docs/spec.md §2)."""
    return torch.float8_e4m3fnuz if (gcn_arch(device) or "").startswith("gfx94") else torch.float8_e4m3fn
