"""DeepSeek-V4's compressed indexer (one key per 4 tokens, docs/spec.md §4a) on the GPU at V4's shapes (H = 64,
D = 128, pages of 64 keys, topk 512 and 1024): every GPU backend of the step (Triton, and auto: the fastest of
each op) against the float64 model, the prefix contract on every row, the cache bytes equal to the reference's,
and a captured decode step replayed with new lengths equal to eager.
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate
from sparse_indexer.testing import assert_topk, capture_cuda_graph
from tests.sparse_indexer.test_compressed import Compressed

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _lim(topk: int, next_n: int, **kw) -> IndexerLimits:
    base = dict(max_model_len=32768, max_num_batched_tokens=4096, max_num_seqs=8, next_n=next_n, n_heads=64,
                head_dim=128, topk=topk, block_size=64, compress_ratio=4, max_logits_bytes=4 * 900_000)
    base.update(kw)
    return IndexerLimits(**base)


# (seq_lens in tokens, query_lens, next_n): decode rows over windows longer than topk, short requests, a prefill
# of more query rows than keys split along its queries
STEPS = {
    "decode_next_n2_and_prefill": ([20000, 9000, 3, 30001, 8192], [2, 1, 2, 2, 1024], 2),
    "decode_next_n1_and_prefill": ([32768, 4099, 2, 12000, 700], [1, 1, 1, 700, 600], 1),
}


def _run(sc: Compressed, backend, dev):
    md = si.build_metadata(sc.seq, sc.qry, sc.block_table.to(dev), sc.slot_mapping.to(dev), sc.lim,
                           num_blocks=sc.kv.shape[0])
    kv = sc.kv.to(dev)
    out = torch.full((md.num_tokens + 2, sc.lim.topk), 7, dtype=torch.int32, device=dev)
    si.sparse_attn_indexer(sc.q.to(dev), sc.k.to(dev), sc.w.to(dev), kv, md, allocate(sc.lim, dev), out,
                           backend=backend)
    return out.cpu(), kv.cpu()


@pytest.mark.parametrize("topk", [512, 1024])
@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("backend", ["triton", None])
def test_compressed_step_matches_the_model(name, topk, backend):
    seq, qry, nn = STEPS[name]
    sc = Compressed(seq, qry, lim=_lim(topk, nn), seed=topk + len(name))
    got, kv = _run(sc, backend, DEV)
    t = sum(qry)
    assert bool((got[t:] == 7).all())
    # the GPU's FP8 tensor-core sums (Hopper's wgmma keeps fewer accumulator bits than float32): selected scores
    # within 1e-3 x max|score| of the k-th best, the tolerance of `python -m sparse_indexer check` on a GPU
    assert_topk(got[:t], sc.model_scores(), rtol=1e-3, threshold=True)
    for row, n in zip(got[:t], sc.windows()):
        valid = int((row >= 0).sum())
        assert valid == min(n, topk) and bool((row[:valid] >= 0).all()), (n, valid)
    _, kv_ref = _run(sc, "reference", "cpu")
    assert torch.equal(kv, kv_ref), "the step's compressed key writes differ from the reference's"


@pytest.mark.parametrize("next_n", [1, 2])
def test_captured_compressed_decode_replays_new_lengths(next_n):
    """A decode step of 4 requests captured once; the metadata's tensors get a new step's lengths (copied in
    place, as an engine does) and the replay equals an eager step on them."""
    lim = _lim(512, next_n, max_model_len=16384)
    steps = [[9000, 16384, 4001, 77], [16000, 2, 12345, 5000]]
    scs = [Compressed(seq, [next_n] * 4, lim=lim, seed=i) for i, seq in enumerate(steps)]
    # one cache and block table for both steps: the second step's requests reuse the first's blocks
    bt = torch.arange(4 * (16384 // 4 // 64), dtype=torch.int32).view(4, -1)
    kvs = si.new_kv_cache(bt.numel() + 1, 64, 128, device=DEV)
    for sc in scs:
        sc.block_table = bt
    q = scs[0].q.to(DEV)
    w = scs[0].w.to(DEV)
    bufs = allocate(lim, DEV)

    def md_of(sc):
        return si.build_metadata(sc.seq, sc.qry, bt.to(DEV), torch.full((4 * next_n,), -1, device=DEV), lim)

    # keys of both steps' requests in one cache (the second step's are longer or shorter: any content works)
    g = torch.Generator().manual_seed(3)
    si.write_k_cache(torch.randn(bt.numel() * 64, 128, generator=g).bfloat16().to(DEV), kvs,
                     torch.arange(bt.numel() * 64, device=DEV), backend="triton")
    md0 = md_of(scs[0])
    out = torch.full((4 * next_n, 512), 7, dtype=torch.int32, device=DEV)
    si.sparse_attn_indexer(q, None, w, kvs, md0, bufs, out)  # compiles the kernels outside the capture
    graph = capture_cuda_graph(lambda: si.sparse_attn_indexer(q, None, w, kvs, md0, bufs, out))
    md1 = md_of(scs[1])
    for name, t in md0.tensors().items():
        t.copy_(md1.tensors()[name])
    graph.replay()
    torch.cuda.synchronize()
    want = torch.full_like(out, 7)
    si.sparse_attn_indexer(q, None, w, kvs, md_of(scs[1]), allocate(lim, DEV), want)
    assert torch.equal(out.sort(1).values, want.sort(1).values)
