"""``torch.compile(fullgraph=True)`` of a function that calls ``sparse_attn_indexer`` (reference backend, CPU).

What is asserted, exactly:
1. Dynamo traces the whole step (checks, host metadata, every op) as one graph: ``fullgraph=True`` compiles.
2. The compiled step gives the same ``topk_out`` as eager, writes the same K cache, and leaves the same bytes in
   the buffers (so it wrote the caller's buffers, not a private copy).
3. In the generated code (``run_and_get_code``): no ``clone``; every ``sparse_indexer`` op call that writes a
   buffer field or the K cache gets the caller's tensor (a graph input ``argN_1`` or a ``reinterpret_tensor``
   view of one, never a temporary ``bufN``), and the generated code allocates nothing (no ``empty_strided_*``):
   ``topk_out`` is written in place too.

The record is ``allocate(...).split_storages()``: the same bytes, each field its own storage (AOTAutograd
rejects input mutations on aliased views of different dtypes, which a carved arena's fields are).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import sparse_indexer as si
from buffers import allocate
from tests.sparse_indexer.test_indexer import Scenario, limits

ALLOC = re.compile(r"empty_strided_\w+\(\(([\d, ]*)\), \(([\d, ]*)\), torch\.(\w+)\)")


def _step(q, k, w, kv, md, bufs, out):
    si.sparse_attn_indexer(q, k, w, kv, md, bufs, out, backend="reference")


@pytest.mark.parametrize("next_n", [1, 2])
def test_compiled_step_matches_eager_without_copying_buffers(next_n):
    torch._dynamo.reset()
    lim = limits(next_n=next_n, n_heads=16, head_dim=64, topk=8, max_model_len=128, max_num_batched_tokens=64,
                 max_num_seqs=4, prefill_k_tokens=1024, max_logits_bytes=4 * 4096)
    sc = Scenario([40, 7, 50, 30], [next_n, 1, 20, 30], lim=lim, seed=1)  # decode (non-uniform for 2) + prefill
    md = sc.metadata()
    assert md.decode is not None and md.prefill_chunks
    bufs = allocate(lim)
    for x in bufs.tensors().values():
        x.view(torch.uint8).zero_()
    kv0 = sc.kv.clone()
    t = md.num_tokens
    want = torch.full((t + 2, lim.topk), 7, dtype=torch.int32)
    _step(sc.q, sc.k, sc.w, sc.kv, md, bufs, want)
    kv_want, bytes_want = sc.kv.clone(), {n: x.view(torch.uint8).clone() for n, x in bufs.tensors().items()}

    sc.kv.copy_(kv0)
    for x in bufs.tensors().values():
        x.view(torch.uint8).zero_()
    cb = bufs.split_storages()
    assert all(cb.tensors()[n].data_ptr() == x.data_ptr() for n, x in bufs.tensors().items())
    got = torch.full((t + 2, lim.topk), 7, dtype=torch.int32)
    _, codes = run_and_get_code(torch.compile(_step, fullgraph=True), sc.q, sc.k, sc.w, sc.kv, md, cb, got)

    assert torch.equal(got, want)
    assert torch.equal(sc.kv, kv_want)
    for n, x in bufs.tensors().items():
        assert torch.equal(x.view(torch.uint8), bytes_want[n]), f"buffer {n} differs from eager"

    code = "\n".join(codes)
    call = code[code.index("def call("):]
    assert "clone(" not in call
    ops = [ln for ln in call.splitlines() if "torch.ops.sparse_indexer." in ln]
    assert len(ops) >= 5
    for ln in ops:  # buffer fields and the cache reach the ops as graph inputs, never as a temporary bufN
        args = ln.split("(", 1)[1]
        if ".top_k_per_row." in ln:
            args = args.split(", arg", 1)[0]  # the logits argument
        assert not re.search(r"\bbuf\d+", args), ln
    allocs = ALLOC.findall(call)
    assert not allocs, f"the compiled step allocates {allocs}"
