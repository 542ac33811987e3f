"""Two pipelines on one GPU: two CUDA streams, each with its own ``Buffers`` arena and cache, driven by two host
threads at once (auto backend: every kernel the step picks), give the results of the same steps run one after
the other on one stream: the same cache bytes, and each top-k row the same positions (in any order, docs/spec.md
§6). A kernel launched on the wrong stream, or a scratch tensor shared behind the records, shows as a difference.
Run: ``PYTHONPATH=. python3 -m pytest -q tests/gpu/test_streams_gpu.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

import sparse_indexer as si
from buffers import allocate
from tests.gpu.test_engine_gpu import World, _lim

pytestmark = pytest.mark.gpu
DEV = "cuda"
STEPS = 12


def _pipeline(seed: int, lim, batches):
    """A cache, an arena and the step inputs of ``batches`` (``(seq_lens, query_lens)`` each)."""
    wd = World(lim, max(len(s) for s, _ in batches), seed=seed)
    steps = [wd.inputs(seq, qry) for seq, qry in batches]
    return wd, allocate(lim, DEV), steps


def _run(wd, bufs, steps, kv0, stream=None):
    """Every step twice (two layers) from the cache ``kv0``: the outputs and the final cache."""
    outs = []
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        wd.kv.copy_(kv0)
        for i in range(STEPS):
            q, k, w, md = steps[i % len(steps)]
            out = torch.full((md.num_tokens, wd.lim.topk), -7, dtype=torch.int32, device=DEV)
            for _ in range(2):
                si.sparse_attn_indexer(q, k, w, wd.kv, md, bufs, out)
            outs.append(out)
        kv = wd.kv.clone()
    return outs, kv


@pytest.mark.parametrize("next_n", [1, 2])
def test_two_streams_give_the_serial_bytes(next_n):
    lim = _lim(next_n=next_n, max_logits_bytes=4 * 300_000)
    a = _pipeline(1, lim, [([900, 4096, 33, 2000], [next_n] * 4), ([700, 1200, 2500], [1, 300, 200])])
    b = _pipeline(2, lim, [([64, 3000], [next_n, 2 if next_n == 2 else 1]), ([4000] * 6, [next_n] * 6),
                           ([1500, 800], [next_n, 500])])
    kv0 = {id(p): p[0].kv.clone() for p in (a, b)}
    serial = {id(p): _run(*p, kv0[id(p)]) for p in (a, b)}  # warm-up too: first compiles happen here
    torch.cuda.synchronize()
    streams = {id(a): torch.cuda.Stream(), id(b): torch.cuda.Stream()}
    got, errors = {}, []

    def drive(p):
        try:
            got[id(p)] = _run(*p, kv0[id(p)], stream=streams[id(p)])
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(f"{type(e).__name__}: {e}")

    for _ in range(3):
        threads = [threading.Thread(target=drive, args=(p,)) for p in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        assert errors == []
        for p, name in ((a, "A"), (b, "B")):
            outs, kv = got[id(p)]
            want_outs, want_kv = serial[id(p)]
            assert torch.equal(kv, want_kv), f"pipeline {name}: the cache differs from the serial run's"
            for i, (o, wo) in enumerate(zip(outs, want_outs)):  # positions of a row in any order (docs/spec.md §6)
                assert torch.equal(o.sort(1).values, wo.sort(1).values), \
                    f"pipeline {name}, step {i}: the top-k differs from the serial run's"
