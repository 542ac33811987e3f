"""aiter backend of ``write_k_cache``, and the cache layout every aiter op agrees on (docs/spec.md §4).

aiter's gfx942/gfx950 paged-logits kernel (``deepgemm_fp8_paged_mqa_logits``) reads a *preshuffled* cache when
the block size is a multiple of 16: the value region of each block in 16x16-byte tiles, value byte of (token t,
dim d) at ``(t // 16) * 16 * D + (d // 16) * 256 + (t % 16) * 16 + (d % 16)``; scales unchanged. Under
``backend="aiter"`` the cache is preshuffled exactly when :func:`preshuffled` says so (gfx942 with
e4m3fnuz or gfx950 with e4m3fn, block size a multiple of 16), and the aiter ``write_k_cache``,
``gather_k_cache`` and ``fp8_paged_mqa_logits`` all use that rule, so a cache must be written and read by the
aiter backend throughout. Elsewhere the layout is docs/spec.md §4's plain one, and the aiter paged kernel raising
``NotImplementedError`` (auto then falls back to Triton) is safe.

The writer is pure torch (quantize, then scatter to the preshuffled byte offsets): it runs on any device and
is tested on the CPU against the reference.
"""

from __future__ import annotations

import importlib

import torch

from ...fp8 import quantize_k
from ...kcache import cache_layout
from . import reference

__all__ = ["NATIVE_FP8", "gcn_arch", "preshuffled", "preshuffle_offsets", "raw_blocks", "write_k_cache",
           "write_k_cache_preshuffled"]

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


def write_k_cache_preshuffled(k, kv_cache, slot_mapping, *, scale_fmt, fp8_dtype) -> None:
    """docs/spec.md §3 quantization, stored in the preshuffled layout (``kv_cache`` 3-D, arguments checked)."""
    s = slot_mapping.shape[0]
    if s == 0:
        return
    raw, scales = raw_blocks(kv_cache)
    bs, d = kv_cache.shape[1], k.shape[1]
    offs = preshuffle_offsets(bs, d, k.device)
    k_fp8, k_scale = quantize_k(k[:s], fp8_dtype=fp8_dtype, scale_fmt=scale_fmt)
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // bs, slots % bs
    raw[blk[:, None], offs[off]] = k_fp8[keep].view(torch.uint8)
    scales[blk, off] = k_scale[keep]


def write_k_cache(k, kv_cache, slot_mapping, *, scale_fmt, fp8_dtype) -> None:
    """See :func:`sparse_indexer.write_k_cache`; preshuffled when :func:`preshuffled` says so."""
    if preshuffled(kv_cache.shape[1], fp8_dtype, gcn_arch(kv_cache.device)):
        write_k_cache_preshuffled(k, kv_cache, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)
    else:
        reference.write_k_cache(k, kv_cache, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)
