"""vLLM 0.33's own ``DeepseekV32IndexerMetadataBuilder`` driven on the CPU, the way vLLM's GPU model runner drives
it (``gpu_model_runner._build_attention_metadata``), including the padding of FULL CUDA graph batches.

It runs on the CPU when the process starts with (tests/run.sh gives the builder tests their own process):

* ``TRITON_INTERPRET=1``: the builder's two metadata kernels (uniform flattened decode, prefill chunk windows)
  are Triton kernels; Triton's interpreter runs them on CPU tensors. Read when triton is imported.
* ``CUDA_VISIBLE_DEVICES=""``: without an active GPU driver, ``vllm.triton_utils`` replaces triton by a
  placeholder unless this variable is set and empty.
* ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1``: the builder's logits budget for prefill chunks (512 MB by default),
  so that small batches split into chunks.

``python -m tests.compat.vllm_builder`` (with that environment) rewrites ``FIXTURE``: vLLM's metadata of padded
decode steps for the GPU test (``tests/gpu/test_vllm_shim_gpu.py``), which runs where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import attrs
import torch

import sparse_indexer as si

ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "1"}
FIXTURE = Path(__file__).with_name("vllm_padded_decode.json")
LOGITS_MB = 1


def env_problem() -> str | None:
    """Why vLLM's builder cannot run in this process (``None``: it can)."""
    bad = [f"{k}={v!r}" for k, v in ENV.items() if os.environ.get(k) != v]
    if bad:
        return "vLLM's builder on the CPU needs its own process started with " + " ".join(bad)
    return None


ARCHITECTURES = {1: "DeepseekV32ForCausalLM", 2: "DeepseekV41ForCausalLM", 4: "DeepseekV4ForCausalLM"}


class Engine:
    """One engine configuration: vLLM's builder for it and the matching :class:`IndexerLimits`.

    vLLM side: a real ``VllmConfig`` (scheduler, attention with ``sparse_mla_prefill_workspace_factor``,
    parallel, compilation: defaults), except ``model_config`` and ``speculative_config``, whose real classes
    need a Hugging Face model: narrow namespaces with the fields the builder reads (``max_model_len`` and
    ``architectures``; ``num_speculative_tokens`` and ``enable_adaptive_verification``). The indexer cache's
    ``MLAAttentionSpec`` as ``DeepseekV32IndexerCache.get_kv_cache_spec`` makes it, or with ``compress_ratio``
    ``C > 1`` as DeepSeek-V4's ``DeepseekV4IndexerCache`` does (``tokens_per_state=C``, its page alignment):
    ``block_size`` counts tokens per page, ``block_size // C`` compressed entries (the spec's ``num_states``).

    ``v41``: DeepSeek-V4.1's engine (``architectures`` ``DeepseekV41ForCausalLM``; its indexer caches are
    ``DeepseekV4IndexerCache``'s spec at every ratio, ``tokens_per_state=C`` also for ``C = 1``).

    Our side: the limits :class:`~sparse_indexer.compat.vllm.VllmIndexer` derives from the op's arguments
    (``prefill_k_tokens`` = vLLM's prefill workspace ``max_model_len * 8 * factor // C`` keys, the same logits
    budget, ``block_size // C`` keys per block; a two-level indexer layer's add ``candidate_blocks`` and
    ``candidate_block_size``: :meth:`candidate_limits`).
    ``op_max_model_len`` and ``op_total_seq_lens`` are what the model passes the op (``// C``),
    ``workspace_keys`` the builder's prefill key workspace.
    """

    def __init__(self, next_n: int, *, max_model_len: int = 96, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, block_size: int = 16, workspace_factor: int = 2,
                 n_heads: int = 8, head_dim: int = 64, topk: int = 16, compress_ratio: int = 1,
                 layer: str = "model.layers.0.self_attn.indexer.k_cache", v41: bool = False):
        from vllm.config import AttentionConfig, DeviceConfig, SchedulerConfig, VllmConfig
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.mla import indexer as vi
        from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

        cr = compress_ratio
        if block_size % cr:
            raise ValueError(f"block_size {block_size} (tokens per page) must be a multiple of compress_ratio {cr}")
        self.next_n, self.compress_ratio, self.layer = next_n, cr, layer
        cfg = VllmConfig(
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=max_model_len, is_encoder_decoder=False),
            attention_config=AttentionConfig(sparse_mla_prefill_workspace_factor=workspace_factor),
            device_config=DeviceConfig(device="cpu"),
        )
        arch = "DeepseekV41ForCausalLM" if v41 else ARCHITECTURES[cr]
        cfg.model_config = SimpleNamespace(max_model_len=max_model_len, architectures=[arch])
        if next_n > 1:
            cfg.speculative_config = SimpleNamespace(num_speculative_tokens=next_n - 1,
                                                     enable_adaptive_verification=False)
        self.vllm_config = cfg
        if cr == 1 and not v41:
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_dim + 4,
                                    dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
        else:
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_dim + 4,
                                    dtype=torch.uint8, tokens_per_state=cr, alignment=576)
            assert spec.num_states == block_size // cr
        # vLLM's unspecified (CPU) platform raises NotImplementedError on num_compute_units. The builder only
        # sizes its DeepGEMM schedule buffer with it ([SMs + 1, 2] int32), which is filled on CUDA only.
        with mock.patch.object(current_platform, "num_compute_units", lambda device_id=0: 1):
            self.builder = vi.DeepseekV32IndexerMetadataBuilder(
                spec, [layer], cfg, torch.device("cpu"),
                block_table_width=(max_model_len + block_size - 1) // block_size)
        assert self.builder.compress_ratio == cr
        self.workspace_keys = self.builder.max_prefill_buffer_size  # vLLM's // C
        self.op_max_model_len = max_model_len // cr
        self.op_total_seq_lens = vi.get_max_prefill_buffer_size(cfg) // cr
        assert self.op_total_seq_lens == self.workspace_keys
        self.limits = si.IndexerLimits(
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            next_n=next_n, n_heads=n_heads, head_dim=head_dim, topk=topk, block_size=block_size // cr,
            compress_ratio=cr, prefill_k_tokens=max(self.workspace_keys, max_model_len // cr),
            max_logits_bytes=LOGITS_MB * 2**20,
            min_prefill_query_len=1,  # as VllmIndexer.limits
        )

    def candidate_limits(self, candidate_blocks: int, candidate_block_size: int = 8) -> si.IndexerLimits:
        """The limits of a two-level indexer layer (DeepSeek-V4.1) of this engine: ``candidate_blocks`` (``K_b``,
        the columns of the op's candidate buffer) blocks of ``candidate_block_size`` keys."""
        return attrs.evolve(self.limits, candidate_blocks=candidate_blocks,
                            candidate_block_size=candidate_block_size)

    def common_metadata(self, batch, *, pad_reqs: int = 0, pad_tokens: int = 0):
        """``CommonAttentionMetadata`` of ``batch`` as the model runner fills it: ``pad_reqs`` padding requests
        (query length 0: ``query_start_loc`` repeats its last entry; ``seq_lens`` 0; block table rows of the null
        block 0) and ``pad_tokens`` padding tokens (counted in ``num_actual_tokens``, ``slot_mapping`` -1) for a
        FULL CUDA graph; ``slot_mapping`` padded with -1 to the batch's query rows in any case."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qry, seq = batch.query_lens, batch.seq_lens
        qsl = [0]
        for q in qry:
            qsl.append(qsl[-1] + q)
        qsl += [qsl[-1]] * pad_reqs
        seqp = list(seq) + [0] * pad_reqs
        bt = torch.cat([batch.block_table, torch.zeros(pad_reqs, batch.block_table.shape[1], dtype=torch.int32)])
        rows = max(batch.rows, batch.num_tokens + pad_tokens)
        slots = torch.full((rows,), -1, dtype=torch.int64)
        slots[: batch.num_tokens] = batch.slot_mapping
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=i32(qsl), query_start_loc_cpu=i32(qsl), seq_lens=i32(seqp),
            num_reqs=len(seqp), num_actual_tokens=batch.num_tokens + pad_tokens, max_query_len=max(qry),
            max_seq_len=max(seq), block_table_tensor=bt, slot_mapping=slots, seq_lens_cpu_upper_bound=i32(seqp),
            is_prefilling=torch.zeros(len(seqp), dtype=torch.bool),
        )

    def build(self, batch, *, pad_reqs: int = 0, pad_tokens: int = 0):
        """vLLM's ``DeepseekV32IndexerMetadata`` of ``batch`` from the builder's real ``build()``."""
        return self.builder.build(0, self.common_metadata(batch, pad_reqs=pad_reqs, pad_tokens=pad_tokens))


# ------------------------------------------------------------------------------------------------ GPU fixture
# Padded decode steps for the CUDA-graph test: per next_n, a capture step with B requests of next_n tokens each
# (what vLLM captures: a uniform batch of the graph's size) and replay steps with fewer real requests, padded to B
# by vLLM, with new lengths and block tables. Shapes of a real engine (block size 64, H = 64, D = 128).
FIXTURE_ENGINE = dict(max_model_len=4096, block_size=64, max_num_seqs=8, max_num_batched_tokens=64, n_heads=64,
                      head_dim=128, topk=512)
FIXTURE_NUM_BLOCKS = 4 * 4096 // 64 + 8
FIXTURE_B = 4
FIXTURE_STEPS = {
    # next_n: [(seq_lens, query_lens) of the capture step, then of each replay step]
    nn: [([3000, 377, 4096, 1200], [nn] * 4), ([4096, 2100, 33], [nn] * 3), ([95, 3500], [nn] * 2),
         ([700, 1500, 2500, 600], [nn] * 4)]
    for nn in (1, 2, 3)
}
# The same for DeepSeek-V4's compressed indexer (compress ratio 4): 256-token pages of 64 entries, H = 64,
# D = 128, top-512, contexts of up to 8192 tokens (2048 keys), among them requests shorter than 4 tokens (no
# key: all -1) and contexts that are no multiple of 4. Keyed "c4_n<next_n>".
FIXTURE_ENGINE_V4 = dict(max_model_len=8192, block_size=256, max_num_seqs=8, max_num_batched_tokens=64, n_heads=64,
                         head_dim=128, topk=512, compress_ratio=4)
FIXTURE_NUM_BLOCKS_V4 = 4 * 8192 // 256 + 8
FIXTURE_STEPS_V4 = {
    f"c4_n{nn}": (nn, [([6001, 754, 8192, 2403], [nn] * 4), ([8192, 4203, 3], [nn] * 3), ([190, 7002], [nn] * 2),
                       ([1401, 2, 5000, 1203], [nn] * 4)])
    for nn in (1, 2)
}
FIXTURE_FIELDS = ("seq_lens", "decode_lens", "block_table")


def _tensor_json(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.reshape(-1).tolist()}


def _fixture_rows(eng: Engine, steps, num_blocks: int, seed0: int) -> list[dict]:
    from tests.compat.vllm_batches import make_batch

    rows = []
    nn = eng.next_n
    for i, (seq, qry) in enumerate(steps):
        pad_reqs = FIXTURE_B - len(seq)
        batch = make_batch(seq, qry, eng.limits, seed=seed0 + i, num_blocks=num_blocks, extra_rows=pad_reqs * nn,
                           layout_only=True)
        md = eng.build(batch, pad_reqs=pad_reqs, pad_tokens=pad_reqs * nn)
        d = md.decode
        row = {
            "seq_lens_of_requests": seq, "query_lens": qry, "num_decodes": md.num_decodes,
            "num_decode_tokens": md.num_decode_tokens, "num_prefills": md.num_prefills,
            "num_prefill_tokens": md.num_prefill_tokens, "requires_padding": bool(d.requires_padding),
            "slot_mapping": _tensor_json(md.slot_mapping[: md.num_decode_tokens]),
            "request_block_table": _tensor_json(batch.block_table),
            **{f: _tensor_json(getattr(d, f)) for f in FIXTURE_FIELDS},
        }
        if eng.compress_ratio > 1:  # the lengths in tokens, padding requests 0: padded compressed decode reads them
            row["md_seq_lens"] = _tensor_json(md.seq_lens)
        rows.append(row)
    return rows


def fixture_steps() -> dict:
    """vLLM's metadata of :data:`FIXTURE_STEPS` and :data:`FIXTURE_STEPS_V4` from the real builder, as JSON-able
    dicts."""
    out = {}
    for nn, steps in FIXTURE_STEPS.items():
        eng = Engine(nn, **FIXTURE_ENGINE)
        out[str(nn)] = {"engine": FIXTURE_ENGINE, "num_blocks": FIXTURE_NUM_BLOCKS,
                        "steps": _fixture_rows(eng, steps, FIXTURE_NUM_BLOCKS, 100 * nn)}
    for key, (nn, steps) in FIXTURE_STEPS_V4.items():
        eng = Engine(nn, **FIXTURE_ENGINE_V4)
        out[key] = {"engine": FIXTURE_ENGINE_V4, "num_blocks": FIXTURE_NUM_BLOCKS_V4,
                    "steps": _fixture_rows(eng, steps, FIXTURE_NUM_BLOCKS_V4, 1000 + 100 * nn)}
    return out


def fixture_json(steps: dict) -> str:
    """The fixture's text: one line per step."""
    lines = ["{"]
    for i, (nn, v) in enumerate(steps.items()):
        lines.append(f' "{nn}": {{"engine": {json.dumps(v["engine"])}, "num_blocks": {v["num_blocks"]}, "steps": [')
        lines += [f"  {json.dumps(st)}" + ("," if j < len(v["steps"]) - 1 else "") for j, st in enumerate(v["steps"])]
        lines.append(" ]}" + ("," if i < len(steps) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def main() -> None:
    problem = env_problem()
    if problem:
        raise SystemExit(problem)
    FIXTURE.write_text(fixture_json(fixture_steps()))
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
