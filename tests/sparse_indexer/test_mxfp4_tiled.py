"""MXFP4 caches in aiter's tiled byte order (``CacheFormat.tiled_mxfp4``, ``"tiled:N,C,L"``, docs/spec.md §3a) on
the backend under test: the cache write lays out exactly the bytes that aiter's permutations of the flat order
give (written here from their definition: values ``[run, chunk, key, byte]``, scales ``[run, s % L, key, s //
L]``), the gather reads back the flat bytes, the paged scores equal the flat cache's, and a whole step on a tiled
cache selects what it selects on the flat one. Bad orders are refused before anything is written."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat, IndexerLimits, allocate
from sparse_indexer.kcache import mxfp4_offsets

pytestmark = pytest.mark.uses_ops("write_k_cache", "gather_k_cache", "fp8_paged_mqa_logits", "fp8_mqa_logits",
                                  "top_k_per_row")

FLAT = CacheFormat(values="mxfp4")
TILES = [((32, 16, 2), 64, 128), ((16, 16, 4), 32, 128), ((32, 16, 1), 32, 64), ((16, 8, 2), 16, 64)]


def _tiled_bytes(flat: torch.Tensor, n: int, c: int, lanes: int) -> torch.Tensor:
    """The tiled bytes of each block of a flat MXFP4 cache ``[nb, bs, D / 2 + D / 32]``, by aiter's reshapes."""
    nb, bs, width = flat.shape
    d = width * 32 // 17
    raw = flat.reshape(nb, -1)
    vals = raw[:, : bs * d // 2].reshape(nb, bs // n, n, d // 2 // c, c).permute(0, 1, 3, 2, 4)
    scales = raw[:, bs * d // 2 :].reshape(nb, bs // n, n, d // 32 // lanes, lanes).permute(0, 1, 4, 2, 3)
    return torch.cat([vals.reshape(nb, -1), scales.reshape(nb, -1)], 1)


def _caches(tile, bs, d, g, nb=5):
    fmt = CacheFormat.tiled_mxfp4(*tile)
    keys = torch.randn(nb * bs, d, generator=g) * torch.logspace(-2, 1, d)
    slots = torch.randperm(nb * bs, generator=g)[: nb * bs - 3]
    flat, tiled = si.new_kv_cache(nb, bs, d, mxfp4=True), si.new_kv_cache(nb, bs, d, mxfp4=True)
    si.write_k_cache(keys[: len(slots)], flat, slots, cache_format=FLAT, backend="reference")
    return fmt, keys[: len(slots)], slots, flat, tiled


def test_offsets_of_the_flat_order_and_a_permutation():
    v, s = mxfp4_offsets(16, 64)
    assert torch.equal(v, torch.arange(16 * 32).view(16, 32)) and torch.equal(s, 16 * 32 + torch.arange(32).view(16, 2))
    v, s = mxfp4_offsets(64, 128, "tiled:32,16,2")
    assert torch.equal(torch.cat([v.flatten(), s.flatten()]).sort().values, torch.arange(64 * 68))


@pytest.mark.parametrize("tile,bs,d", TILES)
def test_write_gather_and_paged_scores(backend, tile, bs, d):
    g = torch.Generator().manual_seed(bs + d + tile[0])
    fmt, keys, slots, flat, tiled = _caches(tile, bs, d, g)
    si.write_k_cache(keys, tiled, slots, cache_format=fmt, backend=backend)
    assert torch.equal(tiled.reshape(tiled.shape[0], -1), _tiled_bytes(flat, *tile))
    nb = flat.shape[0]
    bt = torch.randperm(nb, generator=g)[:4].int().view(2, 2)
    cu = torch.tensor([0, bs + 3, 2 * bs + 3 + bs // 2], dtype=torch.int32)
    n = int(cu[-1])
    want = (torch.empty(n, d // 2, dtype=torch.uint8), torch.empty(n, d // 32, dtype=torch.uint8))
    got = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    si.gather_k_cache(flat, bt, cu, out_k=want[0], out_scale=want[1], cache_format=FLAT, backend="reference")
    si.gather_k_cache(tiled, bt, cu, out_k=got[0], out_scale=got[1], cache_format=fmt, backend=backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    qv, qs = si.quantize_q_mxfp4(torch.randn(4, 8, d, generator=g))
    w = torch.randn(4, 8, generator=g)
    cl = torch.tensor([bs + 7, 2 * bs], dtype=torch.int32)
    q4, qs4 = qv.view(2, 2, 8, d // 2), qs.view(2, 2, 8, d // 32)
    a = si.fp8_paged_mqa_logits(q4, flat, w, cl, bt, cache_format=FLAT, q_scale=qs4, backend=backend)
    b = si.fp8_paged_mqa_logits(q4, tiled, w, cl, bt, cache_format=fmt, q_scale=qs4, backend=backend)
    assert torch.equal(a, b)


def test_a_step_on_a_tiled_cache_selects_what_the_flat_one_does(backend):
    base = dict(max_model_len=256, max_num_batched_tokens=512, max_num_seqs=4, n_heads=32, head_dim=64, topk=16,
                block_size=32, next_n=2)
    g = torch.Generator().manual_seed(5)
    seq, qry = [70, 130, 40], [2, 1, 30]
    bt = torch.tensor([[0, 1, 2, 13, 13], [3, 4, 5, 6, 7], [8, 9, 13, 13, 13]], dtype=torch.int32)
    keys = torch.randn(sum(seq), 64, generator=g).to(torch.bfloat16)
    q, qs = si.quantize_q_mxfp4(torch.randn(sum(qry), 32, 64, generator=g))
    w = torch.randn(sum(qry), 32, generator=g)
    sels = []
    for fmt in (FLAT, CacheFormat.tiled_mxfp4(32)):
        lim = IndexerLimits(**base, cache_format=fmt)
        kv = si.new_kv_cache(14, 32, 64, mxfp4=True)
        slots, ks, o = [], [], 0
        for r, (s, n) in enumerate(zip(seq, qry)):
            pos = torch.arange(s)[None, :]
            sl = si.slots_from_block_table(bt[r : r + 1], pos, 32)[0]
            si.write_k_cache(keys[o : o + s - n], kv, sl[: s - n], cache_format=fmt, backend="reference")
            slots.append(sl[s - n :])
            ks.append(keys[o + s - n : o + s])
            o += s
        md = si.build_metadata(seq, qry, bt, torch.cat(slots), lim, num_blocks=14)
        out = torch.full((sum(qry), 16), 7, dtype=torch.int32)
        si.sparse_attn_indexer(q, torch.cat(ks), w, kv, md, allocate(lim), out, q_scale=qs, backend=backend)
        sels.append(out.sort(1).values)
    assert torch.equal(sels[0], sels[1])


@pytest.mark.parametrize("order", ["tiled:32,16", "tiled:0,16,2", "tiled:a,16,2", "tiled:x"])
def test_malformed_orders(order):
    with pytest.raises(ValueError, match="tiled:N,C,L"):
        CacheFormat(values="mxfp4", order=order)


def test_an_order_that_does_not_tile_the_block_writes_nothing():
    fmt = CacheFormat.tiled_mxfp4(32)
    kv = si.new_kv_cache(2, 16, 64, mxfp4=True)  # 16-key blocks: no run of 32
    before = kv.clone()
    with pytest.raises(ValueError, match="multiple of 32"):
        si.write_k_cache(torch.randn(3, 64), kv, torch.arange(3), cache_format=fmt)
    assert torch.equal(kv, before)
    with pytest.raises(ValueError, match="multiple of 32"):
        si.gather_k_cache(kv, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                          out_k=torch.empty(3, 32, dtype=torch.uint8), out_scale=torch.empty(3, 2, dtype=torch.uint8),
                          cache_format=fmt)
