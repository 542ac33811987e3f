"""A padded vLLM decode step replayed the way vLLM's FULL CUDA graphs replay it, shared by
tests/gpu/test_vllm_shim_gpu.py (CUDA graph, auto backend) and tests/compat/test_vllm_metadata.py (CPU, reference
backend, eager stand-in for the replay).

vLLM captures a decode graph with a uniform batch of the graph's size and replays it with fewer real requests,
padded to that size (padding requests of length 0, padding tokens with slot -1), after its metadata builder has
written the new step into the same persistent tensors. The shim converts vLLM's metadata inside the op (first
layer of a step), so the conversion is captured too and must be replayed, not reused.

The metadata is vLLM 0.33's own builder output, stored in tests/compat/vllm_padded_decode.json (so that it can be
used where vLLM is not installed; ``python -m tests.compat.vllm_builder`` regenerates it, and
tests/compat/test_vllm_builder.py checks it against the builder): DeepSeek-V3.2 steps (keys "1" to "3", the
next_n) and DeepSeek-V4 steps on its compressed indexer cache (compress ratio 4, keys "c4_n1", "c4_n2"), where
the model's compressor has written every key before the op (``k=None``, ``skip_k_cache_insert=True``) and vLLM's
decode lengths, windows and slots are compressed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch

import sparse_indexer as si
from buffers import allocate, plan
from sparse_indexer.compat.vllm import VllmIndexer

FIXTURE = Path(__file__).with_name("vllm_padded_decode.json")
LAYER = "model.layers.0.self_attn.indexer.k_cache"
SEVEN = 7


def _tensor(j: dict, device) -> torch.Tensor:
    return torch.tensor(j["data"], dtype=getattr(torch, j["dtype"])).view(j["shape"]).to(device)


class Workspace:
    """Stands in for vLLM's workspace manager (not installed here): ``get_simultaneous`` hands out views of one
    arena at the plan's offsets, as vLLM's manager does for the plan's fields in one call."""

    def __init__(self, limits, device):
        self.plan = plan(limits)
        self.bufs = allocate(limits, device)

    def is_locked(self) -> bool:
        return False

    def get_simultaneous(self, *specs):
        assert [tuple(s) for s, _ in specs] == [f.shape for f in self.plan.fields]
        return tuple(getattr(self.bufs, f.name) for f in self.plan.fields)


def _vllm_md(step: dict, t: dict, requires_padding: bool):
    """A ``DeepseekV32IndexerMetadata`` (decode only) over the tensors ``t``: a new object each call, as vLLM
    builds one per step (``seq_lens``, the lengths in tokens, where the fixture has them: compressed caches)."""
    return SimpleNamespace(
        seq_lens=t.get("md_seq_lens"), slot_mapping=t["slot_mapping"], num_decodes=step["num_decodes"],
        num_decode_tokens=step["num_decode_tokens"],
        num_prefills=0, num_prefill_tokens=0, prefill=None,
        decode=SimpleNamespace(seq_lens=t["seq_lens"], decode_lens=t["decode_lens"], block_table=t["block_table"],
                               requires_padding=requires_padding, indices=None, schedule_metadata=None),
    )


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(1).values, b.sort(1).values)


def fixture_key(next_n: int, compress_ratio: int = 1) -> str:
    """The fixture's key of the padded decode steps of ``next_n`` on a cache of ``compress_ratio``."""
    return str(next_n) if compress_ratio == 1 else f"c{compress_ratio}_n{next_n}"


def check_padded_decode_replay(device: str, next_n: int, capture_step: int, compress_ratio: int = 1) -> None:
    """Capture (CUDA) the op on step ``capture_step`` of the fixture (0: the uniform step vLLM captures, 1: a
    padded one), then replay every step with its lengths, block tables, slots, queries and keys copied into the
    captured tensors. Each replay must equal the eager op on the same inputs (a new metadata object with the
    step's own tensors and flags) and our own path (``build_metadata`` + ``sparse_attn_indexer`` from the real
    lengths); padding rows are -1, rows past the graph's tokens untouched. On the CPU (reference backend) a new
    metadata object over the persistent tensors, with the capture step's flags, stands in for the replay.

    ``compress_ratio`` 4: DeepSeek-V4's steps. The cache holds a random key in every entry (written by the model's
    compressor before the op: the op gets ``k=None`` and writes nothing); the op's lengths are ``// 4``; our own
    path gets vLLM's compressed slot mapping, which ``build_metadata`` checks against the block table."""
    cr = compress_ratio
    fx = json.loads(FIXTURE.read_text())[fixture_key(next_n, cr)]
    eng, steps = fx["engine"], fx["steps"]
    assert eng.get("compress_ratio", 1) == cr
    g = torch.Generator().manual_seed(10 * next_n + capture_step + 1000 * (cr - 1))
    h, d, topk = eng["n_heads"], eng["head_dim"], eng["topk"]
    bs = eng["block_size"] // cr  # keys per block
    op_len = eng["max_model_len"] // cr  # the op's max_model_len and total_seq_lens (as the V3.2 steps)
    compressed = cr > 1
    backend = None if device == "cuda" else "reference"
    model_len = eng["max_model_len"] if compressed else None
    op = VllmIndexer(max_num_seqs=eng["max_num_seqs"], next_n=next_n, backend=backend, model_max_model_len=model_len)
    topk_rows = eng["max_num_batched_tokens"]
    out = torch.full((topk_rows, topk), SEVEN, dtype=torch.int32, device=device)
    rows = steps[0]["num_decode_tokens"]  # the graph's token count: every step is padded to it
    q_buf = torch.zeros(rows, h, d, dtype=torch.float8_e4m3fn, device=device)
    k_buf = None if compressed else torch.zeros(rows, d, dtype=torch.bfloat16, device=device)
    w_buf = torch.zeros(rows, h, dtype=torch.float32, device=device)
    nb = fx["num_blocks"]
    kv0 = si.new_kv_cache(nb, bs, d, device=device)  # every slot holds a random key
    si.write_k_cache(torch.randn(nb * bs, d, generator=g).to(device), kv0, torch.arange(nb * bs, device=device),
                     backend=backend)
    kv = kv0.clone()
    limits = op.limits(kv, q_buf, topk, d, op_len, op_len, out, compress_ratio=cr, skip_k_cache_insert=compressed)
    assert limits.max_model_len == eng["max_model_len"] and limits.compress_ratio == cr
    op = VllmIndexer(max_num_seqs=eng["max_num_seqs"], next_n=next_n, backend=backend, model_max_model_len=model_len,
                     manager=Workspace(limits, device), attn_metadata=lambda: state["md"])
    state = {}

    def args(q, k, w, kv_cache, topk_out):
        return (torch.empty(q.shape[0], 1, device=device), LAYER, kv_cache, q, k, w, d, "ue8m0", topk, d,
                op_len, op_len, topk_out, compressed, cr)

    # vLLM's persistent metadata tensors, holding the capture step
    fields = ("seq_lens", "decode_lens", "block_table", "slot_mapping") + (("md_seq_lens",) if compressed else ())
    persistent = {f: _tensor(steps[capture_step][f], device) for f in fields}
    cap = steps[capture_step]
    assert cap["num_decode_tokens"] == rows and all(s["num_decode_tokens"] == rows for s in steps)
    capture_md = {LAYER: _vllm_md(cap, persistent, cap["requires_padding"])}

    def new_inputs():
        q, qs = si.quantize_q(torch.randn(rows, h, d, generator=g))
        w = (torch.randn(rows, h, generator=g) * qs / math.sqrt(h * d)).float()
        k = torch.randn(rows, d, generator=g).to(torch.bfloat16)
        return q.to(device), None if compressed else k.to(device), w.to(device)

    def fill(q, k, w):
        q_buf.copy_(q), w_buf.copy_(w)
        if k is not None:
            k_buf.copy_(k)

    # eager warm-up with the capture metadata object (compiles the kernels); the same object is then captured:
    # the shim must convert it again inside the capture
    state["md"] = capture_md
    q, k, w = new_inputs()
    fill(q, k, w)
    if device == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            op(*args(q_buf, k_buf, w_buf, kv, out))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        kv.copy_(kv0)
        with torch.cuda.graph(graph):
            op(*args(q_buf, k_buf, w_buf, kv, out))
        replay = graph.replay
    else:
        def replay():  # a new object per step over the same tensors, with the capture step's flags
            state["md"] = {LAYER: _vllm_md(cap, persistent, cap["requires_padding"])}
            op(*args(q_buf, k_buf, w_buf, kv, out))

    for i, step in enumerate(steps):
        n_real = sum(step["query_lens"])
        q, k, w = new_inputs()
        # the new step into the captured tensors (vLLM's builder writes its persistent buffers the same way)
        for f in fields:
            new = _tensor(step[f], device)
            assert new.shape == persistent[f].shape, f"step {i}: {f} {tuple(new.shape)} is not the graph's shape"
            persistent[f].copy_(new)
        fill(q, k, w)
        kv.copy_(kv0)
        out.fill_(SEVEN)
        replay()
        if device == "cuda":
            torch.cuda.synchronize()
        got, kv_got = out.clone(), kv.clone()

        # eager on the same inputs, with this step's own metadata (fresh tensors, vLLM's flags)
        state["md"] = {LAYER: _vllm_md(step, {f: _tensor(step[f], device) for f in fields}, step["requires_padding"])}
        kv_e = kv0.clone()
        out_e = torch.full_like(out, SEVEN)
        op(*args(q, k, w, kv_e, out_e))
        assert _same_rows(got, out_e), f"step {i}: replay differs from eager"
        assert torch.equal(kv_got, kv_e), f"step {i}: the replayed cache write differs from eager"

        # our own path from the real lengths
        bt = _tensor(step["request_block_table"], device)
        md = si.build_metadata(step["seq_lens_of_requests"], step["query_lens"], bt,
                               _tensor(step["slot_mapping"], device)[:n_real], limits)
        kv_o = kv0.clone()
        out_o = torch.full_like(out, SEVEN)
        si.sparse_attn_indexer(q, k, w, kv_o, md, allocate(limits, device), out_o, backend=backend)
        assert _same_rows(got, out_o), f"step {i}: replay differs from build_metadata + sparse_attn_indexer"
        assert torch.equal(kv_got, kv_o)
        assert bool((got[n_real:rows] == -1).all()), f"step {i}: padding rows are not -1"
        assert bool((got[rows:] == SEVEN).all()), f"step {i}: rows past the graph's tokens were written"
        assert bool((got[:n_real] >= 0).any())
        if compressed:  # nothing written: the compressor's keys stay
            assert torch.equal(kv_got, kv0)
            # the prefix contract V4's attention relies on (it reads the first min(window, topk) entries unchecked):
            # a window of n <= topk keys gives the positions 0..n-1 first (any order), then -1
            lens = [(s - q + j + 1) // cr for s, q in zip(step["seq_lens_of_requests"], step["query_lens"])
                    for j in range(q)]
            for t, n in enumerate(lens):
                if n <= topk:
                    head, tail = got[t, :n].sort().values.cpu(), got[t, n:]
                    assert torch.equal(head, torch.arange(n, dtype=torch.int32)) and bool((tail == -1).all()), (
                        f"step {i}: token {t} (window {n}) breaks the prefix contract")
