"""How a kernel developer tests an op on the CPU against the emulated-FP8 reference.

Run: ``python examples/cpu_unit_test.py`` (reference vs a float64 recomputation), or, to exercise a Triton
kernel on the CPU through Triton's interpreter: ``TRITON_INTERPRET=1 python examples/cpu_unit_test.py triton``.

The reference backend upcasts FP8 exactly to float32 and accumulates in float32, so on the CPU it is the
specification: compare your backend with it on random paged inputs whose block tables are permuted and whose
lengths are not multiples of the block size.
"""

from __future__ import annotations

import sys

import torch

import sparse_indexer as si


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    backend = argv[0] if argv else "reference"
    torch.manual_seed(0)
    b, next_n, h, d, bs = 3, 2, 32, 128, 16
    lens = torch.tensor([37, 5, 60], dtype=torch.int32)  # not multiples of the block size
    max_blocks = 4
    nb = b * max_blocks + 2
    kv = si.new_kv_cache(nb, bs, d)
    block_table = torch.randperm(nb)[: b * max_blocks].view(b, max_blocks).int()
    for r in range(b):  # fill each request's keys through its block table
        pos = torch.arange(int(lens[r]))[None]
        slots = si.slots_from_block_table(block_table[r : r + 1], pos, bs)[0]
        si.write_k_cache(torch.randn(int(lens[r]), d), kv, slots)
    q = torch.randn(b, next_n, h, d).to(torch.float8_e4m3fn)
    w = torch.randn(b * next_n, h)

    got = si.fp8_paged_mqa_logits(q, kv, w, lens, block_table, backend=backend)
    ref = si.fp8_paged_mqa_logits(q, kv, w, lens, block_table, backend="reference")

    # an independent float64 recomputation from the cache bytes
    values, scales = si.cache_views(kv, torch.float8_e4m3fn)
    want = torch.full_like(ref, float("-inf"), dtype=torch.float64)
    for r in range(b):
        blk = block_table[r].long()
        k = values[blk].reshape(-1, d).double() * scales[blk].reshape(-1, 1).double()
        for j in range(next_n):
            lim = max(0, int(lens[r]) - next_n + j + 1)
            s = (q[r, j].double() @ k[:lim].T).clamp(min=0)
            want[r * next_n + j, :lim] = w[r * next_n + j].double() @ s
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), "-inf masks differ"
    err = ((got.double()[fin] - want[fin]).norm() / want[fin].norm()).item()
    print(f"{backend}: paged logits {tuple(got.shape)}, relative L2 error vs float64 {err:.2e}; "
          f"max |{backend} - reference| {(got[fin] - ref[fin]).abs().max().item():.2e}")
    assert err < 1e-5 if backend == "reference" else err < 1e-3
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
