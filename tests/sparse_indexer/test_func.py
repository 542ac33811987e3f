"""``torch.func``: the reference path of the step under ``functionalize`` (traced with ``make_fx``), and ``vmap``
scoring a stack of layers at once (decode scoring and top-k; ``Buffers`` is a pytree node with a batched arena).

Under ``torch.func`` transforms the public functions run the pure-torch reference directly (mutating custom ops
are not accepted by functorch). Covered by vmap: ``fp8_paged_mqa_logits`` + ``top_k_per_row`` (the decode
scoring) over layers, each layer with its own K cache; ``write_k_cache``/``gather_k_cache`` read tensor values
on the host in their references and are not vmapped.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree

import sparse_indexer as si
from buffers import Buffers, allocate, plan
from tests.sparse_indexer.test_indexer import Scenario, limits

LIM = limits(next_n=1, n_heads=16, head_dim=64, topk=8, max_model_len=128, max_num_batched_tokens=64,
             max_num_seqs=4, prefill_k_tokens=256, max_logits_bytes=4 * 4096)


def test_buffers_is_a_pytree_node():
    b = allocate(LIM)
    leaves, spec = _pytree.tree_flatten(b)
    assert [x is None for x in leaves] == [False, False, False, True, True, True, True, True, True]
    b2 = _pytree.tree_unflatten(leaves, spec)
    assert isinstance(b2, Buffers) and all(getattr(b2, n) is getattr(b, n) for n in ("k_fp8", "k_scale", "logits"))


def test_functionalize_writes_only_buffers_and_outputs():
    sc = Scenario([40, 7, 50], [1, 1, 20], lim=LIM, seed=2)
    md = sc.metadata()
    bufs = allocate(LIM)

    def step(q, k, w, kv, bufs, out):
        si.sparse_attn_indexer(q, k, w, kv, md, bufs, out, backend="reference")

    out = torch.full((md.num_tokens, LIM.topk), 7, dtype=torch.int32)
    kv0 = sc.kv.clone()
    want = out.clone()
    step(sc.q, sc.k, sc.w, sc.kv, bufs, want)
    kv_want = sc.kv.clone()

    sc.kv.copy_(kv0)
    f = torch.func.functionalize(step, remove="mutations_and_views")
    f(sc.q, sc.k, sc.w, sc.kv, bufs, out)  # runs functionally, copies results back into the inputs
    assert torch.equal(out, want) and torch.equal(sc.kv, kv_want)

    # make_fx tracing refuses what the cache references do (gather reads int(cu_seq_lens[-1]); write_k_cache
    # mutates through an as_strided view, which functionalization bans while tracing): trace the decode part
    # of a step (paged logits into the buffers, top-k into topk_out) after writing the cache eagerly.
    sc = Scenario([40, 7, 50], [1, 1, 1], lim=LIM, seed=3)
    md = sc.metadata()
    si.write_k_cache(sc.k, sc.kv, md.slot_mapping)
    out = torch.full((md.num_tokens, LIM.topk), 7, dtype=torch.int32)

    def decode(q, k, w, kv, bufs, out):
        si.indexer_decode(q, w, kv, md, bufs, out, backend="reference")

    gm = make_fx(torch.func.functionalize(decode, remove="mutations_and_views"))(sc.q, sc.k, sc.w, sc.kv, bufs, out)
    nodes = list(gm.graph.nodes)
    ph = [n.target for n in nodes if n.op == "placeholder"]
    # the leaves
    fields = ("k_fp8", "k_scale", "logits", "qk", "q_pack", "q_scale_pack", "w_pack", "topk_pack", "cand_pack")
    names = ["q", "k", "w", "kv", *[f"bufs.{n}" for n in fields], "out"]
    assert len(ph) == len(names)
    name_of = dict(zip(ph, names))
    calls = [n for n in nodes if n.op == "call_function"]
    copies = [n for n in calls if n.target is torch.ops.aten.copy_.default]
    written = sorted(name_of[c.args[0].target] for c in copies)
    # only the buffer that decode uses (logits) and topk_out are written, each once
    assert written == sorted(["bufs.logits", "out"])
    # ... by the trailing copy_ nodes: nothing is computed after them, and no other op mutates anything
    first_copy = calls.index(copies[0])
    assert calls[first_copy:] == copies
    mutating = [n for n in calls if n not in copies and getattr(n.target, "_schema", None) is not None
                and n.target._schema.is_mutable]
    assert mutating == [], mutating


def _stack_buffers(lim, layers: int) -> Buffers:
    """A batched arena ``[layers, total_bytes]`` carved into a record whose fields are ``[layers, ...]`` stacks
    (validators off: they check one layer's shapes)."""
    p = plan(lim)
    arena = torch.zeros(layers, p.total_bytes, dtype=torch.uint8)
    views = {f.name: arena[:, f.offset : f.offset + f.nbytes].view(f.dtype).view(layers, *f.shape) for f in p.fields}
    with attrs.validators.disabled():
        return Buffers(**views)


def _vmap_views_dtypes() -> bool:
    """torch 2.11 has no vmap batching rule for ``Tensor.view(dtype)`` (the cache's FP8 and scale views); 2.13 has."""
    try:
        torch.vmap(lambda x: x.view(torch.float32))(torch.zeros(2, 8, dtype=torch.uint8))
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _vmap_views_dtypes(), reason="this torch has no vmap batching rule for view(dtype)")
@pytest.mark.parametrize("next_n", [1, 2])
def test_vmap_scores_a_stack_of_layers(next_n):
    lim = limits(next_n=next_n, n_heads=16, head_dim=64, topk=8, max_model_len=128, max_num_batched_tokens=64,
                 max_num_seqs=4)
    layers = 3
    scs = [Scenario([40, 7, 100, 64], [next_n] * 4, lim=lim, seed=20 + i, layout_seed=20) for i in range(layers)]
    md = scs[0].metadata()
    dm = md.decode
    assert dm.uniform
    rows = dm.num_rows

    def score(q, w, kv, bufs, out):
        logits = bufs.logits_view(rows, dm.width)
        si.fp8_paged_mqa_logits(q.view(dm.num_reqs, next_n, *q.shape[1:]), kv, w, dm.context_lens, dm.block_table,
                                out=logits, clean=False, backend="reference")
        si.top_k_per_row(logits, dm.row_starts, dm.row_ends, out=out, backend="reference")
        return out

    q = torch.stack([sc.q for sc in scs])
    w = torch.stack([sc.w for sc in scs])
    kv = torch.stack([sc.kv.reshape(sc.kv.shape[0], sc.kv.shape[1], -1) for sc in scs])
    bufs = _stack_buffers(lim, layers)
    out = torch.full((layers, rows, lim.topk), 7, dtype=torch.int32)
    bufs_dims = _pytree.tree_map(lambda x: None if x is None else 0, bufs, is_leaf=lambda x: x is None)  # in_dims
    torch.func.vmap(score, in_dims=(0, 0, 0, bufs_dims, 0))(q, w, kv, bufs, out)

    single = allocate(lim)
    for i, sc in enumerate(scs):
        want = torch.full((rows, lim.topk), 7, dtype=torch.int32)
        score(sc.q, sc.w, sc.kv, single, want)
        assert torch.equal(out[i], want), f"layer {i}"
