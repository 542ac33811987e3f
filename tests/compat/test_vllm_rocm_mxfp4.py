"""The vLLM shim's ROCm MXFP4 entry (``VllmIndexer.rocm_mxfp4``, vLLM 0.33's ``rocm_mxfp4_sparse_attn_indexer``)
on metadata from vLLM's own ``RocmMxfp4IndexerMetadataBuilder.build()`` for DeepSeek-V4's compressed indexer cache
(``C = 4``) and a ratio-1 cache, with MXFP4 keys in aiter's tiled page order where the shim finds the order
(vLLM's ``rocm_paged_mxfp4_cache_layout``, fed by a stand-in for aiter's ``cache_format`` written from aiter's
published rule: ``N = 32`` when ``D <= 64`` or ``H >= 32``, else 16; ``C = 16``). aiter's kernels are not needed:
the builder only asks it for a schedule, and the stand-in answers ``None`` (the static grid), which vLLM accepts.

Every token's top-k must be a top-k of a float64 model of its window's MXFP4 scores and equal our own path's
(``build_metadata`` + ``sparse_attn_indexer``); chunks that hold more keys than the plan's gather buffers are
split by requests; the queries' scales arrive as vLLM's one int32 per head.

Own process (tests/run.sh): ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1``.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.compat.vllm_builder import env_problem

if env_problem():
    pytest.skip(env_problem(), allow_module_level=True)
rocm_ops = pytest.importorskip("vllm.v1.attention.ops.rocm_paged_mxfp4_indexer")
rocm_md = pytest.importorskip("vllm.v1.attention.backends.mla.rocm_paged_mxfp4_indexer")
ws = pytest.importorskip("vllm.v1.worker.workspace")

from vllm.forward_context import set_forward_context  # noqa: E402

import sparse_indexer as si  # noqa: E402
from buffers import CacheFormat, allocate  # noqa: E402
from sparse_indexer.compat.vllm import VllmIndexer, rocm_mxfp4_cache_format  # noqa: E402
from tests.compat.vllm_batches import SEVEN, make_batch, same_rows  # noqa: E402
from tests.compat.vllm_builder import Engine  # noqa: E402
from tests.sparse_indexer.test_indexer import check_topk  # noqa: E402
from tests.sparse_indexer.test_indexer_mxfp4 import _dequant  # noqa: E402


class _Aiter:
    """What vLLM's builder asks aiter's paged MXFP4 module for."""

    SCHED_SLOT_CAP = 64

    @staticmethod
    def cache_format(num_heads, head_size, page_size):
        n = 32 if head_size <= 64 or num_heads >= 32 else 16
        return {"n_per_tile": n, "d_per_tile": 16, "block_kv": min(64, page_size)}

    @staticmethod
    def select_config(num_heads, head_size, next_n, page_size, preshuffle=1, clean_logits=True):
        return {"target_wgs": 16}

    @staticmethod
    def build_schedule(*args, **kwargs):
        return None


@pytest.fixture(autouse=True)
def stand_in_aiter():
    rocm_ops.rocm_paged_mxfp4_cache_layout.cache_clear()
    rocm_mxfp4_cache_format.cache_clear()
    with mock.patch.object(rocm_ops, "_aiter", lambda: _Aiter):
        yield
    rocm_ops.rocm_paged_mxfp4_cache_layout.cache_clear()
    rocm_mxfp4_cache_format.cache_clear()


def _builder(eng: Engine, h: int, d: int, cr: int, block_size: int):
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    cfg = eng.vllm_config
    cfg.model_config.hf_text_config = SimpleNamespace(index_n_heads=h, index_head_dim=d)
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=d // 2 + d // 32,
                            dtype=torch.uint8, tokens_per_state=cr, alignment=576)
    with mock.patch.object(current_platform, "num_compute_units", lambda device_id=0: 1):
        return rocm_md.RocmMxfp4IndexerMetadataBuilder(
            spec, [eng.layer], cfg, torch.device("cpu"),
            block_table_width=(cfg.model_config.max_model_len + block_size - 1) // block_size)


# name: (C, next_n, H, D, seq_lens, query_lens, engine kwargs)
CASES = {
    "c4_decode_and_prefill_h64": (4, 1, 64, 128, [400, 130, 61, 255], [1, 1, 40, 30], {}),
    "c4_uniform_decode_n2_h16": (4, 2, 16, 64, [300, 133, 250], [2, 2, 2], {}),
    # vLLM's prefill workspace 160 * 8 * 2 = 2560 keys; its ROCm builder makes one chunk of 17 * 160
    "c1_prefill_split_by_keys": (1, 1, 32, 64, [100] + [160] * 17, [1] + [14] * 17,
                                 {"max_model_len": 160, "max_num_batched_tokens": 256, "max_num_seqs": 32}),
}


def _mxfp4_batch(seq, qry, lim, fmt, seed):
    b = make_batch(seq, qry, lim, seed=seed, layout_only=True)
    g = torch.Generator().manual_seed(seed)
    cr, bs, d, h = lim.compress_ratio, lim.block_size, lim.head_dim, lim.n_heads
    nb = int(b.block_table.max()) + 4
    kv = si.new_kv_cache(nb, bs, d, mxfp4=True)
    keys = [torch.randn(s // cr, d, generator=g) * torch.logspace(-1, 1, d) for s in seq]
    for r, s in enumerate(seq):  # the model wrote every key of the step before the op
        if s // cr:
            slots = si.slots_from_block_table(b.block_table[r : r + 1], torch.arange(s // cr)[None], bs)[0]
            si.write_k_cache(keys[r], kv, slots, cache_format=fmt, backend="reference")
    q_float = torch.randn(b.rows, h, d, generator=g)
    qv, qs = si.quantize_q_mxfp4(q_float)
    w = torch.randn(b.rows, h, generator=g) * (h * d) ** -0.5
    b.__dict__.update(kv=kv, keys=keys, q_float=q_float, qv=qv, qs=qs, w=w)
    return b


def _model(b, cr):
    q64 = _dequant(*si.quantize_q_mxfp4(b.q_float))
    out, t = [], 0
    for r, (s, q) in enumerate(zip(b.seq_lens, b.query_lens)):
        k64 = _dequant(*si.quantize_k_mxfp4(b.keys[r])) if b.keys[r].shape[0] else torch.zeros(0, q64.shape[-1])
        for j in range(q):
            n = (s - q + j + 1) // cr
            out.append(b.w[t].double() @ (q64[t] @ k64[:n].T.double()).clamp(min=0))
            t += 1
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_rocm_mxfp4_shim_on_vllm_builder(name, manager, backend):
    cr, nn, h, d, seq, qry, kw = CASES[name]
    block_size = 256 if cr == 4 else 64  # tokens per page: 64 entries, aiter's preferred page
    eng = Engine(nn, compress_ratio=cr, block_size=block_size, n_heads=h, head_dim=d,
                 **{"max_model_len": 1024, "max_num_batched_tokens": 128, **kw})
    builder = _builder(eng, h, d, cr, block_size)
    fmt = rocm_mxfp4_cache_format(h, d, block_size // cr)
    assert fmt == CacheFormat.tiled_mxfp4(32 if d <= 64 or h >= 32 else 16)
    lim = eng.limits
    b = _mxfp4_batch(seq, qry, lim, fmt, seed=len(name))
    vmd = builder.build(0, eng.common_metadata(b))
    assert isinstance(vmd, rocm_md.RocmMxfp4IndexerMetadata)
    op = VllmIndexer.from_vllm_config(eng.vllm_config, backend=backend)
    out = torch.full((lim.max_num_batched_tokens, lim.topk), SEVEN, dtype=torch.int32)
    q_scale = b.qs.view(torch.int32).squeeze(-1) if d == 128 else b.qs  # vLLM's one int32 per head at D = 128
    args = (torch.zeros(b.rows, 8), eng.layer, b.kv, b.qv, q_scale, b.w, lim.topk, d, eng.op_max_model_len, out, cr)
    with set_forward_context(None, eng.vllm_config):  # profiling: reserves the plan
        assert op.rocm_mxfp4(*args) is out
    ws.lock_workspace()
    with set_forward_context({eng.layer: vmd}, eng.vllm_config):
        assert op.rocm_mxfp4(*args) is out
    n = b.num_tokens
    check_topk(out[:n], _model(b, cr), lim.topk)
    assert bool((out[n:] == SEVEN).all())
    # our own path on the same cache
    assert op.prefill_tokens == eng.op_total_seq_lens * cr  # vLLM's prefill workspace rule, in tokens
    ours_lim = op._limits_and_plan(b.kv, b.qv, lim.topk, d, eng.op_max_model_len, eng.op_total_seq_lens, out, cr,
                                   True, 0, 8, fmt)[0]
    md = si.build_metadata(seq, qry, b.block_table, b.key_slots, ours_lim)
    mine = torch.full_like(out, SEVEN)
    si.sparse_attn_indexer(b.qv, None, b.w, b.kv, md, allocate(ours_lim), mine, q_scale=b.qs, backend=backend)
    assert same_rows(out[:n], mine[:n])
    if name == "c1_prefill_split_by_keys":
        assert [c.total_seq_lens for c in vmd.prefill.chunks] == [17 * 160] and ours_lim.prefill_k_tokens == 2560
        chunks = op._metadata(vmd, ours_lim, split_chunks=True).prefill_chunks
        assert len(chunks) > 1 and max(c.num_k_tokens for c in chunks) <= ours_lim.prefill_k_tokens


def test_q_scale_of_the_wrong_size_is_refused():
    op = VllmIndexer(max_num_seqs=2)
    qv = torch.zeros(3, 4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4 scale bytes per head"):
        op.rocm_mxfp4(torch.zeros(3, 8), "x", torch.zeros(2, 64, 68, dtype=torch.uint8), qv,
                      torch.zeros(3, 4, dtype=torch.int32)[:, :2], torch.zeros(3, 4), 16, 128, 64,
                      torch.zeros(8, 16, dtype=torch.int32))
    with pytest.raises(TypeError, match="q_values"):
        op.rocm_mxfp4(torch.zeros(3, 8), "x", torch.zeros(2, 64, 68, dtype=torch.uint8), qv.float(),
                      torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4), 16, 128, 64,
                      torch.zeros(8, 16, dtype=torch.int32))
