"""Two threads calling the same op (and the same step) at once, with different layouts, one of them alternating
with invalid calls: the eager fast path's memos (the last proven layout of each op, the step's plan per metadata
record) must never let an invalid call through nor hand one thread's layout or buffers to the other. The
interpreter is made to switch threads every few bytecodes."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate

ITERS = 150


@pytest.fixture(autouse=True)
def switch_often():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _run(workers) -> list[str]:
    """Run the workers in threads of their own; what each found wrong (an exception included)."""
    errors: list[str] = []

    def guarded(w):
        try:
            w(errors)
        except Exception as e:  # noqa: BLE001 - an unexpected exception is a failure of the test
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=guarded, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _paged(b, nn, h, d, bs, seed):
    g = torch.Generator().manual_seed(seed)
    nb = b * 4 + 1
    kv = si.new_kv_cache(nb, bs, d)
    si.write_k_cache(torch.randn(nb * bs, d, generator=g), kv, torch.arange(nb * bs), backend="reference")
    q, _ = si.quantize_q(torch.randn(b * nn, h, d, generator=g))
    q = q.view(b, nn, h, d)
    w = torch.randn(b * nn, h, generator=g)
    cl = torch.randint(1, 4 * bs, (b,), generator=g, dtype=torch.int32)
    bt = torch.randperm(nb, generator=g)[: b * 4].view(b, 4).int()
    want = si.fp8_paged_mqa_logits(q, kv, w, cl, bt, backend="reference")
    return q, kv, w, cl, bt, want


def test_two_threads_on_one_op_never_skip_a_check():
    a = _paged(3, 2, 8, 64, 16, 1)
    b = _paged(5, 1, 16, 128, 32, 2)

    def valid(args, errors, name):
        q, kv, w, cl, bt, want = args
        out = torch.empty_like(want)
        si.fp8_paged_mqa_logits(q, kv, w, cl, bt, out=out, backend="reference")
        if not torch.equal(out, want):
            errors.append(f"{name}: wrong logits")

    def worker_a(errors):
        for _ in range(ITERS):
            valid(a, errors, "A")

    def worker_b(errors):
        q, kv, w, cl, bt, want = b
        bad_w = w.half()  # weights must be float32
        bad_out = torch.empty(want.shape[0] - 1, want.shape[1])  # one row short
        for i in range(ITERS):
            if i % 2:
                valid(b, errors, "B")
                continue
            for args, out in (((q, kv, bad_w, cl, bt), None), ((q, kv, w, cl, bt), bad_out)):
                try:
                    si.fp8_paged_mqa_logits(*args, out=out, backend="reference")
                except (TypeError, ValueError):
                    continue
                errors.append(f"B: an invalid call passed at iteration {i}")

    assert _run([worker_a, worker_b]) == []


def _step_case(seed, lim):
    g = torch.Generator().manual_seed(seed)
    seq, qry = [40, 70, 100], [1, 1, 30]
    bt = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    kv = si.new_kv_cache(24, lim.block_size, lim.head_dim)
    for r, s in enumerate(seq):  # every key, this step's too (the step gets k=None)
        slots = si.slots_from_block_table(bt[r : r + 1], torch.arange(s)[None], lim.block_size)[0]
        si.write_k_cache(torch.randn(s, lim.head_dim, generator=g), kv, slots, backend="reference")
    slots = torch.cat([si.slots_from_block_table(bt[r : r + 1], torch.arange(s - q, s)[None], lim.block_size)[0]
                       for r, (s, q) in enumerate(zip(seq, qry))])
    md = si.build_metadata(seq, qry, bt, slots, lim, num_blocks=24)
    q, _ = si.quantize_q(torch.randn(sum(qry), lim.n_heads, lim.head_dim, generator=g))
    w = torch.randn(sum(qry), lim.n_heads, generator=g)
    return md, q, w, kv


def test_two_threads_on_one_step_keep_their_buffers_and_checks():
    lim = IndexerLimits(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, n_heads=8, head_dim=64,
                        topk=16, block_size=16)
    md, q, w, kv = _step_case(3, lim)  # one metadata record shared by both threads, as every layer shares it
    bufs = [allocate(lim), allocate(lim)]
    want = torch.empty(q.shape[0], 16, dtype=torch.int32)
    si.sparse_attn_indexer(q, None, w, kv, md, allocate(lim), want, backend="reference")
    want = want.sort(1).values

    def worker(k):
        def run(errors):
            for i in range(ITERS // 3):
                out = torch.full((q.shape[0], 16), 7, dtype=torch.int32)
                if k == 1 and i % 2:
                    bad = torch.full((q.shape[0], 15), 7, dtype=torch.int32)  # topk columns off by one
                    try:
                        si.sparse_attn_indexer(q, None, w, kv, md, bufs[k], bad, backend="reference")
                        errors.append(f"thread {k}: an invalid step passed")
                    except ValueError:
                        pass
                    if not bool((bad == 7).all()):
                        errors.append(f"thread {k}: an invalid step wrote its output")
                    continue
                si.sparse_attn_indexer(q, None, w, kv, md, bufs[k], out, backend="reference")
                if not torch.equal(out.sort(1).values, want):
                    errors.append(f"thread {k}: wrong top-k at iteration {i}")
        return run

    assert _run([worker(0), worker(1)]) == []


def test_two_threads_keep_their_own_routes(monkeypatch):
    """The route ``auto`` picks is kept with the layout a call proved: a thread whose calls a backend's
    ``auto_when`` accepts runs that backend, one whose calls it declines runs the next, however the two
    interleave, and the declined thread's invalid calls (a wrong output dtype, an end past the logits) still
    raise without writing."""
    from sparse_indexer import backends
    from sparse_indexer._runtime import dispatch as _dispatch
    from tests.sparse_indexer import test_backends as toy_module

    calls: list[str] = []

    def toy(logits, row_starts, row_ends, *, out, workspace=None):
        calls.append(threading.current_thread().name)
        _dispatch.implementation("top_k_per_row", "reference")(logits, row_starts, row_ends, out=out)

    toy.auto_when = lambda logits, row_starts, row_ends, *, out, workspace=None: logits.shape[1] >= 256
    monkeypatch.setattr(toy_module, "top_k_per_row", toy)
    backends.register(toy_module.toy_entry())
    _dispatch._resolved.clear()
    _dispatch._routes.cache_clear()
    g = torch.Generator().manual_seed(4)
    cases = {}
    for width in (300, 200):
        x = torch.randn(6, width, generator=g)
        s = torch.tensor([0, 3, 0, 10, 0, 1], dtype=torch.int32)
        e = torch.tensor([width, width - 5, 40, width, 3, width], dtype=torch.int32)
        want = torch.empty(6, 32, dtype=torch.int32)
        si.top_k_per_row(x, s, e, out=want, backend="reference")
        cases[width] = (x, s, e, want)

    def worker(width):
        def run(errors):
            x, s, e, want = cases[width]
            for i in range(ITERS):
                if width == 200 and i % 3 == 1:
                    for kwargs, args in (({"out": torch.full((6, 32), 7)}, (x, s, e)),  # int64 output
                                         ({"out": torch.full((6, 32), 7, dtype=torch.int32)},
                                          (x, s, e + 1))):  # ends one past the logits
                        try:
                            si.top_k_per_row(*args, **kwargs)
                            errors.append(f"{width}: an invalid call passed at iteration {i}")
                        except (TypeError, ValueError):
                            pass
                        if not bool((kwargs["out"] == 7).all()):
                            errors.append(f"{width}: an invalid call wrote its output")
                    continue
                out = torch.full((6, 32), 7, dtype=torch.int32)
                si.top_k_per_row(x, s, e, out=out)
                if not torch.equal(out, want):
                    errors.append(f"{width}: wrong top-k at iteration {i}")
        return run

    def named(width):
        fn = worker(width)

        def run(errors):
            threading.current_thread().name = f"w{width}"
            fn(errors)
        return run

    try:
        assert _run([named(300), named(200)]) == []
    finally:
        backends.unregister("toy")
        _dispatch._resolved.clear()
        _dispatch._routes.cache_clear()
    assert calls == ["w300"] * ITERS, f"the toy ran {len(calls)} calls, from {sorted(set(calls))}"
