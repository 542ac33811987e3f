"""Shared case generators, backend-dependent settings and assertion helpers (the output checks are the public
ones of :mod:`sparse_indexer.testing`; nothing else of the library is imported)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings

from sparse_indexer.testing import LOGITS_RTOL_L2, assert_logits, assert_topk  # noqa: F401 - re-exported
from tests import oracle

BACKENDS = tuple(b for b in os.environ.get("SPARSE_INDEXER_TEST_BACKENDS", "reference").split(",") if b)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SLOW_BACKEND = INTERPRET or "triton" in BACKENDS

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
FP8_IDS = ["e4m3fn", "e4m3fnuz"]
SCALE_FMTS = ["ue8m0", None]


def hyp_settings(**kw):
    """Hypothesis settings for op tests: 10 examples under the Triton interpreter, 40 otherwise."""
    base = dict(max_examples=10 if SLOW_BACKEND else 40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
    base.update(kw)
    return settings(**base)


def skip_unsupported(backend: str, fp8_dtype: torch.dtype) -> None:
    """The Triton interpreter has no float8_e4m3fnuz."""
    if backend == "triton" and fp8_dtype == torch.float8_e4m3fnuz:
        pytest.skip("the Triton interpreter does not support float8_e4m3fnuz")


def supported(backend: str, fp8_dtype: torch.dtype) -> bool:
    """For hypothesis tests (``assume(supported(...))``): a skip inside ``@given`` would skip the whole test."""
    return not (backend == "triton" and fp8_dtype == torch.float8_e4m3fnuz)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ tensors
def random_fp8(shape, fp8_dtype, g: torch.Generator, amp: float = 8.0) -> torch.Tensor:
    """Finite FP8 values, roughly normal with std ``amp`` (|x| <= 200, inside both formats)."""
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * amp).clamp(-200, 200)
    _, codes = oracle.round_to_fp8(x, oracle.fmt(fp8_dtype))
    return codes.view(fp8_dtype)


def random_scales(n: int, g: torch.Generator, pow2: bool = False) -> torch.Tensor:
    """Positive float32 key scales in ``[2**-10, 2**-2]`` (powers of two when ``pow2``)."""
    e = torch.rand(n, generator=g, dtype=torch.float64) * 8 - 10
    s = torch.exp2(e.floor() if pow2 else e)
    return s.float()


def random_weights(rows: int, h: int, g: torch.Generator) -> torch.Tensor:
    """Signed float32 head weights."""
    return (torch.randn(rows, h, generator=g) * 0.25).float()


def int32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int32)


def causal_windows(seq_lens, query_lens) -> tuple[list[int], list[int], list[int]]:
    """``(cu, ks, ke)`` of a chunk of requests gathered back to back (docs/spec.md §5, §8): ``cu`` the key
    offsets, and for every query token (request ``r``'s last ``query_lens[r]`` tokens) its causal window
    ``[ks, ke)`` over its own request's keys."""
    cu, ks, ke = [0], [], []
    for s, q in zip(seq_lens, query_lens):
        for j in range(q):
            ks.append(cu[-1])
            ke.append(cu[-1] + s - q + j + 1)
        cu.append(cu[-1] + s)
    return cu, ks, ke


def empty_cache(num_blocks: int, block_size: int, d: int, pad: int = 0, four_d: bool = False) -> torch.Tensor:
    """A zeroed uint8 cache ``[nb, bs, D + 4]`` (or 4-D) with ``pad`` extra bytes between blocks."""
    width = d + 4
    per_block = block_size * width + pad
    flat = torch.zeros(max(1, num_blocks) * per_block, dtype=torch.uint8)
    kv = flat.as_strided((num_blocks, block_size, width), (per_block, width, 1))
    return kv.unsqueeze(2) if four_d else kv


def storage_snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage (padding included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


@dataclass
class PagedCase:
    kv: torch.Tensor
    block_table: torch.Tensor  # [R, max_blocks] int32
    lens: list[int]
    block_size: int
    head_dim: int
    fp8_dtype: torch.dtype

    @property
    def cu_seq_lens(self) -> torch.Tensor:
        return int32([0] + list(torch.tensor(self.lens, dtype=torch.long).cumsum(0).tolist()))

    def slots(self, r: int) -> torch.Tensor:
        return oracle.slots_of(self.block_table[r], torch.arange(self.lens[r]), self.block_size)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All requests' keys concatenated, read from the bytes by the oracle: (fp8 ``[N, D]``, float32 ``[N]``)."""
        slots = torch.cat([self.slots(r) for r in range(len(self.lens))]) if self.lens else torch.zeros(
            0, dtype=torch.long)
        vbytes, sbytes = oracle.read_slot_bytes(self.kv, slots)
        return vbytes.contiguous().view(self.fp8_dtype), sbytes.contiguous().view(torch.float32).view(-1)


def paged_case(g: torch.Generator, lens, block_size: int, d: int, fp8_dtype, *, pad: int = 0,
               four_d: bool = False, spare_blocks: int = 3, spare_cols: int = 1, junk_unused: bool = False,
               pow2_scales: bool = True) -> PagedCase:
    """A cache filled with random keys (every slot, unused ones too) and a block table whose blocks are a random
    permutation; each request gets ``ceil(len / bs)`` blocks and the table ``spare_cols`` extra columns, whose
    entries are random valid ids or, with ``junk_unused``, ids outside the cache."""
    lens = [int(x) for x in lens]
    need = [math.ceil(n / block_size) for n in lens]
    nb = max(1, sum(need) + spare_blocks)
    kv = empty_cache(nb, block_size, d, pad=pad, four_d=four_d)
    all_slots = torch.arange(nb * block_size)
    oracle.write_slots(kv, all_slots, random_fp8((nb * block_size, d), fp8_dtype, g).view(torch.uint8),
                       random_scales(nb * block_size, g, pow2=pow2_scales))
    if pad:  # fill the padding with junk bytes so that reading it shows up
        flat = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())
        width = block_size * (d + 4)
        for b in range(nb):
            flat[b * (width + pad) + width : (b + 1) * (width + pad)] = 0x7F
    perm = torch.randperm(nb, generator=g)
    max_blocks = max(need, default=0) + spare_cols
    bt = torch.randint(0, nb, (len(lens), max_blocks), generator=g, dtype=torch.int32)
    if junk_unused:
        bt = torch.where(torch.rand(bt.shape, generator=g) < 0.5, nb + 7, -1).to(torch.int32)
    used = 0
    for r, k in enumerate(need):
        bt[r, :k] = perm[used : used + k].to(torch.int32)
        used += k
    return PagedCase(kv=kv, block_table=bt, lens=lens, block_size=block_size, head_dim=d, fp8_dtype=fp8_dtype)


# ------------------------------------------------------------------------------------------------ assertions
def snapshots(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [storage_snapshot(t) for t in tensors]


def assert_unchanged(tensors, before) -> None:
    for i, (t, b) in enumerate(zip(tensors, before)):
        now = storage_snapshot(t)
        assert torch.equal(now, b), f"watched tensor #{i} was written ({int((now != b).sum())} bytes changed)"


def expect_error(exc, name: str, fn, watch=()) -> BaseException:
    """``fn()`` must raise ``exc`` whose message names ``name``, and leave every tensor in ``watch`` unchanged."""
    before = snapshots(*watch)
    with pytest.raises(exc) as info:
        fn()
    assert name in str(info.value), f"message does not name {name!r}: {info.value}"
    assert_unchanged(watch, before)
    return info.value
