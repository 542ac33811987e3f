"""``pack_decode``: the one decode grid builder of ``build_metadata`` and the vLLM shim (docs/spec.md §7)."""

from __future__ import annotations

import torch

from sparse_indexer.metadata import pack_decode


def test_pack_decode_by_hand():
    # requests of 10, 5, 0 (padding) keys with 2, 1, 0 tokens this step; next_n 3; two padding token rows
    lim, pack_src, unpack_src = pack_decode(torch.tensor([10, 5, 0]), torch.tensor([2, 1, 0]), 3, num_rows=5)
    assert lim.dtype == torch.int32 and lim.tolist() == [[9, 10, 0], [5, 0, 0], [0, 0, 0]]
    assert pack_src.tolist() == [0, 1, 1, 2, 2, 2, 0, 0, 0]  # slots past a request's tokens repeat its last
    assert unpack_src.tolist() == [0, 1, 3, 2, 2]  # tokens 0, 1 -> request 0; 2 -> request 1; padding -> slot 2


def test_pack_decode_matches_host_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        nn = int(torch.randint(1, 5, (1,), generator=g))
        b = int(torch.randint(1, 7, (1,), generator=g))
        dl = torch.randint(0, nn + 1, (b,), generator=g)
        seq = dl + torch.randint(0, 50, (b,), generator=g)
        lim, pack_src, unpack_src = pack_decode(seq, dl, nn, num_rows=int(dl.sum()))
        starts = [int(dl[:i].sum()) for i in range(b)]
        want_lim = [[max(0, int(seq[i] - dl[i]) + j + 1) if j < dl[i] else 0 for j in range(nn)] for i in range(b)]
        assert lim.tolist() == want_lim
        assert pack_src.tolist() == [starts[i] + min(j, int(dl[i]) - 1) if dl[i] else 0
                                     for i in range(b) for j in range(nn)]
        assert unpack_src.tolist() == [i * nn + j for i in range(b) for j in range(int(dl[i]))]
