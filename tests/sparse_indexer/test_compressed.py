"""Compressed indexer caches (``IndexerLimits.compress_ratio``, docs/spec.md §4a): one key per ``C`` tokens.

A request of ``L`` tokens has ``L // C`` keys, a query at position ``p`` sees the first ``(p + 1) // C`` of them
(none when ``p + 1 < C``: its row is all -1), a token writes a key only when ``(p + 1) % C == 0``, and the valid
entries of every row are a prefix of length ``min(window, topk)``. The float64 model below keeps every request's
keys unquantized, quantizes them itself (tests/test_indexer.py's ``q64_keys``) and scores each token's window.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate
from tests.cases import SLOW_BACKEND
from tests.sparse_indexer.test_indexer import FN, check_topk, q64_keys


class Compressed:
    """Requests with their compressed keys, a cache holding the keys written before this step, one step."""

    def __init__(self, seq_lens, query_lens, *, lim: IndexerLimits, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        c, bs, h, d = lim.compress_ratio, lim.block_size, lim.n_heads, lim.head_dim
        self.lim, self.seq, self.qry = lim, list(seq_lens), list(query_lens)
        nkeys = [s // c for s in self.seq]
        width = max(1, max(-(-n // bs) for n in nkeys))
        need = sum(-(-n // bs) for n in nkeys)
        perm = torch.randperm(need + 2, generator=g).int()
        self.block_table = torch.full((len(self.seq), width), 10**6, dtype=torch.int32)  # poison unused entries
        o = 0
        for r, n in enumerate(nkeys):
            self.block_table[r, : -(-n // bs)] = perm[o : o + -(-n // bs)]
            o += -(-n // bs)
        self.kv = si.new_kv_cache(need + 2, bs, d)
        self.keys = [torch.randn(n, d, generator=g).to(torch.bfloat16) for n in nkeys]
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):  # keys of groups that ended before this step
            old = (s - q) // c
            if old:
                slots = si.slots_from_block_table(self.block_table[r : r + 1], torch.arange(old)[None], bs)[0]
                si.write_k_cache(self.keys[r][:old], self.kv, slots, backend="reference")
        t = sum(self.qry)
        self.q = (torch.randn(t, h, d, generator=g) * 2).to(FN)
        self.w = torch.randn(t, h, generator=g) / math.sqrt(h * d)
        # k: a row per token, the key of the group it ends (garbage for the others: their slot is -1)
        rows = []
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            for p in range(s - q, s):
                rows.append(self.keys[r][p // c] if (p + 1) % c == 0 else torch.randn(d, generator=g).bfloat16())
        self.k = torch.stack(rows) if rows else torch.empty(0, d, dtype=torch.bfloat16)
        self.slot_mapping = si.compressed_slot_mapping(self.block_table, self.seq, self.qry, bs, compress_ratio=c)

    def metadata(self):
        return si.build_metadata(self.seq, self.qry, self.block_table, self.slot_mapping, self.lim,
                                 num_blocks=self.kv.shape[0])

    def windows(self) -> list[int]:
        return [(p + 1) // self.lim.compress_ratio for s, q in zip(self.seq, self.qry) for p in range(s - q, s)]

    def model_scores(self) -> list[torch.Tensor]:
        out, t = [], 0
        d = self.lim.head_dim
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            kv, ks = q64_keys(self.keys[r]) if self.keys[r].shape[0] else (torch.zeros(0, d).double(), None)
            for p in range(s - q, s):
                n = (p + 1) // self.lim.compress_ratio
                sc = (self.q[t].double() @ kv[:n].T).clamp(min=0)
                out.append((self.w[t].double() @ sc) * ks[:n] if n else torch.zeros(0, dtype=torch.float64))
                t += 1
        return out

    def all_keys_written(self) -> torch.Tensor:
        """A copy of the cache with every key of the step written (what the model's compressor does before the
        indexer op, which then runs with ``k=None``)."""
        kv = self.kv.clone()
        for r, keys in enumerate(self.keys):
            if keys.shape[0]:
                slots = si.slots_from_block_table(self.block_table[r : r + 1], torch.arange(keys.shape[0])[None],
                                                  self.lim.block_size)[0]
                si.write_k_cache(keys, kv, slots, backend="reference")
        return kv


def limits(**kw) -> IndexerLimits:
    base = dict(max_model_len=400, max_num_batched_tokens=512, max_num_seqs=8, n_heads=16, head_dim=64, topk=16,
                block_size=8, compress_ratio=4)
    base.update(kw)
    return IndexerLimits(**base)


def run(sc: Compressed, backend: str, *, k_none: bool = False):
    md = sc.metadata()
    t = md.num_tokens
    out = torch.full((t + 2, sc.lim.topk), 7, dtype=torch.int32)
    kv = sc.all_keys_written() if k_none else sc.kv
    si.sparse_attn_indexer(sc.q, None if k_none else sc.k, sc.w, kv, md, allocate(sc.lim), out, backend=backend)
    assert bool((out[t:] == 7).all()), "rows beyond the step's tokens were written"
    check_topk(out[:t], sc.model_scores(), sc.lim.topk)
    for row, n in zip(out[:t], sc.windows()):  # the prefix contract: valid entries first, exactly min(n, topk)
        valid = int((row >= 0).sum())
        assert valid == min(n, sc.lim.topk) and bool((row[:valid] >= 0).all())
    return md, out[:t], kv


# (seq_lens, query_lens, next_n, compress ratio): decode and prefill, requests shorter than C, odd lengths
CASES = {
    "mixed_c4": ([37, 3, 90, 200, 7, 61], [1, 1, 1, 150, 7, 20], 1, 4),
    "decode_next_n2_c4": ([40, 5, 90, 2], [2, 2, 2, 2], 2, 4),
    "nonuniform_decode_next_n2_c4": ([41, 5, 90, 33], [2, 1, 2, 1], 2, 4),
    "mixed_c2": ([37, 1, 90, 120, 9], [1, 1, 1, 100, 9], 1, 2),
    "decode_next_n3_c4": ([64, 66, 3], [3, 3, 3], 3, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_step_matches_the_model(name, backend):
    seq, qry, nn, c = CASES[name]
    sc = Compressed(seq, qry, lim=limits(next_n=nn, compress_ratio=c), seed=len(name))
    _, _, kv = run(sc, backend)
    # the step wrote exactly the keys of the groups this step completed: the cache equals one written whole
    assert torch.equal(kv, sc.all_keys_written())
    # keys already written by the model's compressor: the step with k=None selects the same (the same kernels:
    # once under the CPU interpreter)
    if not SLOW_BACKEND or name == "mixed_c4":
        run(sc, backend, k_none=True)


def test_prefill_chunks_without_keys_are_minus_one(backend):
    """A chunk whose requests are all shorter than C has no key: no kernel runs and its rows are -1, also between
    two chunks that have keys (the logits cap puts each long request in its own chunk)."""
    lim = limits(max_logits_bytes=4 * 60 * 50, max_num_seqs=8)
    sc = Compressed([200, 3, 2, 3, 240], [60, 3, 2, 3, 50], lim=lim, seed=3)
    md = sc.metadata()
    assert md.empty_rows == ((60, 68),), md.empty_rows
    assert [(c.token_start, c.token_end) for c in md.prefill_chunks] == [(0, 60), (68, 118)]
    _, out, _ = run(sc, backend)
    assert bool((out[60:68] == -1).all())


@pytest.mark.skipif(SLOW_BACKEND, reason="the kernels of more query rows than keys run in mixed_c4 under the "
                    "CPU interpreter; this split, in the reference pass and on the GPU")
def test_long_prompt_has_more_queries_than_keys(backend):
    """One prompt of 200 tokens at C = 4: 200 query rows against 50 keys, split by the logits cap."""
    lim = limits(max_logits_bytes=4 * 50 * 60, n_heads=8)
    sc = Compressed([200], [200], lim=lim, seed=5)
    md = sc.metadata()
    assert [c.num_k_tokens for c in md.prefill_chunks] == [50] * 4 and [c.gather for c in md.prefill_chunks] == [
        True, False, False, False]
    run(sc, backend)


def test_windows_and_slots_in_compressed_units():
    lim = limits(next_n=2)
    seq, qry = [10, 9, 30], [2, 1, 7]
    bt = torch.arange(3 * 2, dtype=torch.int32).view(3, 2)
    sm = si.compressed_slot_mapping(bt, seq, qry, 8, compress_ratio=4)
    # request 0: positions 8, 9 -> none ends a group; request 1: position 8 -> none; request 2: positions 23..29:
    # 23 ends group 5 (slot 5 of block 4), 27 ends group 6
    assert sm.tolist() == [-1, -1, -1, 4 * 8 + 5, -1, -1, -1, 4 * 8 + 6, -1, -1]
    md = si.build_metadata(seq, qry, bt, sm, lim, num_blocks=6)
    d = md.decode
    assert d.context_lens.tolist() == [[9 // 4, 10 // 4], [9 // 4, 0]] and not d.uniform  # packed left-aligned
    (c,) = md.prefill_chunks
    assert c.num_k_tokens == 30 // 4 and c.cu_seqlen_ke.tolist() == [(p + 1) // 4 for p in range(23, 30)]
    # uniform next_n 2: two-dimensional context lengths with each row's own window
    md = si.build_metadata([10, 13], [2, 2], bt[:2], si.compressed_slot_mapping(bt[:2], [10, 13], [2, 2], 8,
                                                                                compress_ratio=4), lim)
    assert md.decode.uniform and md.decode.context_lens.tolist() == [[2, 2], [3, 3]]
    assert md.decode.row_ends.tolist() == [2, 2, 3, 3] and md.decode.width == 400 // 4
    # the token's own slot: a negative one writes no key
    own = torch.tensor([5, 6, 7, -1, 8, 9, 10, 11, 12, 13])
    assert si.compressed_slot_mapping(bt, seq, qry, 8, compress_ratio=4, token_slots=own)[3] == -1


def test_slots_of_tokens_that_end_no_group_raise():
    lim = limits()
    bt = torch.arange(4, dtype=torch.int32).view(1, 4)
    sm = si.compressed_slot_mapping(bt, [20], [12], 8, compress_ratio=4)
    si.build_metadata([20], [12], bt, sm, lim)
    bad = sm.clone()
    bad[0] = 1  # position 8 ends no group of 4 tokens
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 1, but token 0 .* ends no group"):
        si.build_metadata([20], [12], bt, bad, lim)
    bad = sm.clone()
    bad[3] = 9  # position 11 writes key 2, at slot 2
    with pytest.raises(ValueError, match=r"writes request 0's key 2 \(position 11\), whose slot is"):
        si.build_metadata([20], [12], bt, bad, lim)
    with pytest.raises(ValueError, match="compress_ratio"):
        IndexerLimits(max_model_len=3, max_num_batched_tokens=8, max_num_seqs=1, compress_ratio=4)


def test_plan_sizes_in_keys():
    """Decode logits and the gather are sized in keys: max_model_len // C columns, keys of the chunk's requests."""
    lim = IndexerLimits(max_model_len=1 << 20, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2, topk=512,
                        block_size=64, compress_ratio=4)
    assert lim.max_keys == 1 << 18 and lim.prefill_k_tokens == 1 << 18
    p = si.plan(lim)
    assert p["k_fp8"].shape[0] == 1 << 18
    assert p["logits"].shape[0] >= 256 * 2 * (1 << 18)
