"""``scripts/soak.py``: a short serving soak on the CPU reference passes, and its judge fails a wrong cache byte,
a wrong selection and a written padding row (the H200 runs the long soak: docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import torch

import sparse_indexer as si
from buffers import allocate

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def test_a_short_soak_passes_on_the_cpu():
    r = subprocess.run([sys.executable, "scripts/soak.py", "--device", "cpu", "--steps", "60", "--check-every", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "soak passed" in r.stdout and "20 checked, 0 failures" in r.stdout


def test_the_judge_fails_wrong_results():
    lim = soak.limits(small=True)
    world = soak.World(lim, torch.device("cpu"), random.Random(3), "reference")
    seq, qry = [300, 5, 200], [2, 1, 40]
    q, k, w, md, table = world.batch(seq, qry, pad_rows=2)
    before = world.kv.clone()
    out = torch.full((q.shape[0], lim.topk), -7, dtype=torch.int32)
    si.sparse_attn_indexer(q, k, w, world.kv, md, allocate(lim), out, backend="reference")
    args = (world, before, q, k, w, md, table, seq, qry)
    assert soak.check_step(*args, out, 1e-6) == []
    bad = out.clone()
    unused = sorted(set(range(299)) - set(bad[0].tolist()))  # row 0: 299 keys in its window, 32 selected
    bad[0, 0] = unused[0]  # a key the selection left out in place of one it took
    errs = soak.check_step(*args, bad, 1e-6)
    assert errs and "request 0" in errs[0], errs
    pad = out.clone()
    pad[-1, 0] = 3
    assert any("padding rows" in e for e in soak.check_step(*args, pad, 1e-6))
    world.kv.view(-1)[7] ^= 1
    assert any("cache" in e for e in soak.check_step(*args, out, 1e-6))
