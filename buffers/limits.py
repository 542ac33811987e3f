"""Static engine limits that size every scratch buffer of the indexer (docs/spec.md §9)."""

from __future__ import annotations

import attrs
import torch

__all__ = ["CacheFormat", "IndexerLimits", "FP8_DTYPES", "SCALE_ENCODINGS", "BYTE_ORDERS", "VALUE_FORMATS",
           "mxfp4_tile", "LOGITS_DTYPES", "MiB", "DEFAULT_PREFILL_K_TOKENS", "DEFAULT_MAX_LOGITS_BYTES"]

MiB = 1 << 20

# Defaults of the prefill caps: the smallest that kept prefill throughput within 5% of generous caps (2M keys,
# 4 GiB of logits) on 8K-token steps of 2-16 requests with 4K-128K contexts on an H200 (docs/memory.md,
# scripts/memory_bench.py). vLLM's rules (40 x max_model_len keys, 512 MiB of logits) were copied before.
DEFAULT_PREFILL_K_TOKENS = 131072
DEFAULT_MAX_LOGITS_BYTES = 2048 * MiB
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
LOGITS_DTYPES = (torch.float32, torch.bfloat16)


SCALE_ENCODINGS = ("float32", "ue8m0x4")
BYTE_ORDERS = ("flat", "preshuffled")
VALUE_FORMATS = ("fp8", "mxfp4")
TILED = "tiled:"  # an MXFP4 byte order "tiled:N,C,L" (CacheFormat.order)


def mxfp4_tile(order: str) -> tuple[int, int, int]:
    """``(n_per_tile, d_per_tile, scale_lanes)`` of an MXFP4 cache's byte order (docs/spec.md §3a): ``"flat"`` is
    ``(1, 1, 1)`` (every key's value bytes, then every key's scale bytes), ``"tiled:N,C,L"`` is ``(N, C, L)``.
    Raises ``ValueError`` for any other string."""
    if order == "flat":
        return 1, 1, 1
    parts = order[len(TILED):].split(",") if order.startswith(TILED) else ()
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"an MXFP4 byte order is 'flat' or 'tiled:N,C,L' with positive integers N (keys per run), "
                         f"C (value bytes per chunk) and L (scale lanes), got {order!r}")
    n, c, lanes = (int(p) for p in parts)
    return n, c, lanes


def _fp8(inst, attribute, value):
    if value not in FP8_DTYPES:
        raise ValueError(f"CacheFormat.fp8_dtype must be one of {FP8_DTYPES}, got {value!r}")


@attrs.frozen(kw_only=True)
class CacheFormat:
    """How a paged K cache's bytes encode its keys (docs/spec.md §4): what the ops that read a cache must be told,
    since the bytes carry no format.

    Attributes:
        fp8_dtype: the FP8 format of the values (``torch.float8_e4m3fn``, the default, or ``float8_e4m3fnuz``).
            It may differ from the queries' format (DeepSeek-V4's writers emit e4m3fn bytes on every platform,
            also where the queries are e4m3fnuz, gfx942).
        scale: the 4 scale bytes of each key: ``"float32"`` (one float32, the default) or ``"ue8m0x4"`` (four
            equal UE8M0 exponents: scale ``2 ** (byte - 127)``; vLLM's writers on SM100).
        order: the byte order inside a block: ``"flat"`` (all values token after token, then all scales; the
            default) or ``"preshuffled"`` (values in 16 x 16 tiles, byte of ``(t, d)`` at ``(t // 16) * 16 * D +
            (d // 16) * 256 + (t % 16) * 16 + d % 16``, scales flat; aiter's gfx942/gfx950 caches, vLLM's ROCm
            C = 1, 2 caches with more than one entry per block). An MXFP4 cache is ``"flat"`` or
            ``"tiled:N,C,L"`` (aiter's paged MXFP4 order, vLLM's ROCm MXFP4 caches, docs/spec.md §3a: runs of ``N``
            keys, values as ``[C-byte chunk, key, byte]``, scale bytes as ``[scale % L, key, scale // L]``;
            :meth:`tiled_mxfp4`).
        values: ``"fp8"`` (the default: ``D`` FP8 values and 4 scale bytes per key) or ``"mxfp4"`` (docs/spec.md
            §3a: ``D / 2`` bytes of e2m1 values and ``D / 32`` UE8M0 scale bytes per key, block-major as the flat
            order: every key's values, then every key's scale bytes; vLLM's NVIDIA page layout). An MXFP4 format
            has its own scale bytes: ``fp8_dtype`` and ``scale`` must be left at their defaults.
    """

    fp8_dtype: torch.dtype = attrs.field(default=torch.float8_e4m3fn, validator=_fp8)
    scale: str = attrs.field(default="float32")
    order: str = attrs.field(default="flat")
    values: str = attrs.field(default="fp8")

    @scale.validator
    def _scale(self, attribute, value):
        if value not in SCALE_ENCODINGS:
            raise ValueError(f"CacheFormat.scale must be one of {SCALE_ENCODINGS}, got {value!r}")

    @order.validator
    def _order(self, attribute, value):
        if isinstance(value, str) and value.startswith(TILED):
            mxfp4_tile(value)  # (raises for a malformed one)
            if self.values != "mxfp4":
                raise ValueError(f"CacheFormat.order={value!r} is an MXFP4 byte order: it needs values='mxfp4'")
        elif value not in BYTE_ORDERS:
            raise ValueError(f"CacheFormat.order must be one of {BYTE_ORDERS} or (MXFP4) 'tiled:N,C,L', got {value!r}")

    @values.validator
    def _values(self, attribute, value):
        if value not in VALUE_FORMATS:
            raise ValueError(f"CacheFormat.values must be one of {VALUE_FORMATS}, got {value!r}")
        if value == "mxfp4" and (self.fp8_dtype != torch.float8_e4m3fn or self.scale != "float32"
                                 or self.order == "preshuffled"):
            raise ValueError("an MXFP4 CacheFormat has its own scale bytes and byte orders (docs/spec.md §3a): leave "
                             f"fp8_dtype and scale at their defaults and use order 'flat' or 'tiled:N,C,L', got "
                             f"{self.fp8_dtype}, {self.scale!r}, {self.order!r}")

    @property
    def is_default(self) -> bool:
        """e4m3fn values, float32 scales, flat order: what :func:`sparse_indexer.write_k_cache` writes by default."""
        return (self.fp8_dtype == torch.float8_e4m3fn and self.scale == "float32" and self.order == "flat"
                and self.values == "fp8")

    @property
    def mxfp4(self) -> bool:
        """Whether the keys are MXFP4 (docs/spec.md §3a)."""
        return self.values == "mxfp4"

    @classmethod
    def tiled_mxfp4(cls, n_per_tile: int, d_per_tile: int = 16, scale_lanes: int | None = None) -> CacheFormat:
        """The MXFP4 format in aiter's paged order (``"tiled:N,C,L"``; ``scale_lanes`` default ``64 // N``, a
        64-lane wave's). aiter's ``cache_format(H, D, page)`` picks ``N = 32`` when ``D <= 64`` or ``H >= 32``,
        else 16, and ``C = 16``: DeepSeek-V4's 64 heads of 128 give ``tiled:32,16,2``."""
        lanes = 64 // n_per_tile if scale_lanes is None else scale_lanes
        return cls(values="mxfp4", order=f"{TILED}{n_per_tile},{d_per_tile},{lanes}")

    @property
    def tile(self) -> tuple[int, int, int]:
        """An MXFP4 format's ``(n_per_tile, d_per_tile, scale_lanes)`` (:func:`mxfp4_tile`; flat: ``(1, 1, 1)``)."""
        return mxfp4_tile(self.order)

    def key_bytes(self, head_dim: int) -> int:
        """Bytes per key: ``D + 4`` (FP8), ``D / 2 + D / 32`` (MXFP4)."""
        return head_dim // 2 + head_dim // 32 if self.values == "mxfp4" else head_dim + 4


def _positive(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"IndexerLimits.{attribute.name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"IndexerLimits.{attribute.name} must be > 0, got {value}")


def _non_negative(inst, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"IndexerLimits.{attribute.name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"IndexerLimits.{attribute.name} must be >= 0, got {value}")


def _one_of(*allowed):
    def check(inst, attribute, value):
        if value not in allowed:
            raise ValueError(f"IndexerLimits.{attribute.name} must be one of {allowed}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class IndexerLimits:
    """Static limits of an engine, from which :func:`buffers.plan` sizes every buffer.

    Attributes:
        max_model_len: longest context of one request, in tokens (its keys: ``max_model_len // compress_ratio``,
            :attr:`max_keys`).
        max_num_batched_tokens: most query tokens in one step (decode + prefill).
        max_num_seqs: most requests in one step.
        next_n: 1 + number of speculative tokens; decode rows per request.
        n_heads: indexer heads H (32 or 64).
        head_dim: indexer head dim D (64 or 128).
        topk: tokens selected per query (512, 1024 or 2048).
        block_size: entries (keys) per page of the paged K cache, ``kv_cache.shape[1]``: tokens per page with
            ``compress_ratio`` 1, ``tokens per page // compress_ratio`` otherwise (DeepSeek-V4: 256-token pages
            of 64 entries).
        compress_ratio: ``C``, tokens per key of the cache (docs/spec.md §4a): 1 (DeepSeek-V3.2, GLM-5) or more
            (DeepSeek-V4's compressed indexer: 4). A request of ``L`` tokens has ``L // C`` keys; a query at
            position ``p`` sees the first ``(p + 1) // C`` of them; a token writes a key only when ``(p + 1) % C
            == 0``. Lengths given to :func:`sparse_indexer.build_metadata` stay in tokens.
        prefill_k_tokens: gathered keys one prefill chunk may hold (default
            ``max(max_keys, DEFAULT_PREFILL_K_TOKENS = 131072)``, measured on the H200: docs/memory.md); must
            be at least :attr:`max_keys`.
        max_logits_bytes: byte cap of one prefill chunk's ``[M, N]`` logits (default
            ``DEFAULT_MAX_LOGITS_BYTES`` = 2 GiB, measured: docs/memory.md). The plan reserves only what a step
            allowed by the other limits can use of it.
        max_decode_logits_bytes: byte budget of the decode logits, or ``None`` (no budget). When
            ``max_num_seqs * next_n * max_keys * 4`` exceeds it, a decode step scores and selects its
            requests in sub-batches of :attr:`decode_batch` requests that reuse one budget-sized region of
            ``logits`` (docs/memory.md); it must hold at least one request's rows (``next_n * max_keys * 4``;
            ``* 2`` with bfloat16 logits).
        min_prefill_query_len: fewest query tokens a prefill request of a step can have, or ``None`` for
            ``next_n + 1``: :func:`sparse_indexer.build_metadata` makes every request of at most ``next_n`` new
            tokens a decode request. vLLM's metadata builder on ROCm and the CPU also sends requests of 1 to
            ``next_n`` tokens down the prefill path (those whose query length differs from the first decode's),
            so the vLLM shim plans with 1. Fewer queries per request let a chunk hold more requests, so more
            gathered keys (docs/spec.md §9).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``: the queries' format (and the cache's,
            unless ``cache_format`` says otherwise).
        cache_format: the K cache's :class:`CacheFormat`, or ``None`` (default): ``fp8_dtype`` values, float32
            scales, flat order, what the step's own cache write produces. The prefill gather copies keys in
            ``cache_format.fp8_dtype`` (the plan's ``k_fp8`` dtype). :attr:`cache` is the resolved format.
        with_qk: also plan the ``qk`` buffer ``[H, max_num_seqs * next_n, max_keys]`` float32, needed only
            by backends that materialise per-head scores (aiter's paged stage1).
        logits_dtype: dtype of the ``logits`` field: ``torch.float32`` (default) or ``torch.bfloat16`` (half the
            bytes and half the logits traffic; each score rounded once, docs/spec.md §5; selection on the rounded
            values). The prefill chunks stay the same (their cap counts cells: ``max_logits_bytes // 4``).
        compressed_prefill_logits: score prefill chunks into compressed logits (docs/spec.md §5, DeepGEMM's
            ``max_seqlen_k``): a chunk's logits are ``[M, longest window]`` instead of ``[M, its keys]``, so a chunk
            of several requests writes and reads ``M x (longest context)`` cells, not ``M x (sum of contexts)``.
            The plan sizes ``logits`` by the largest such chunk. Default ``False``.
        world_size: ranks of a context-parallel group (:mod:`sparse_indexer.parallel`, docs/spec.md §11) that
            share each request's keys; 1 (default) plans no context-parallel field, more plans ``cp_scratch``
            (the candidates and the merge of one decode sub-batch's rows).
        candidate_blocks: ``K_b``, candidate blocks per row of a two-level indexer (DeepSeek-V4.1, docs/spec.md
            §6a: a source layer publishes them, consumer layers select inside them), or 0 (default: none). With
            ``K_b > 0`` the plan holds the block scores of the source layer's selection (``block_scores``) and,
            when ``next_n > 1``, the packed candidate rows of a non-uniform decode (``cand_pack``); the prefix
            contract of the compressed caches needs ``(K_b - 1) * candidate_block_size + 1 >= topk``.
        candidate_block_size: ``b``, positions per candidate block (default 8, DeepSeek-V4.1's); with
            ``world_size > 1`` it must divide ``block_size`` (each candidate block on one rank).
    """

    max_model_len: int = attrs.field(validator=_positive)
    max_num_batched_tokens: int = attrs.field(validator=_positive)
    max_num_seqs: int = attrs.field(validator=_positive)
    next_n: int = attrs.field(default=1, validator=_one_of(1, 2, 3, 4))
    n_heads: int = attrs.field(default=64, validator=_positive)
    head_dim: int = attrs.field(default=128, validator=_one_of(64, 128))
    topk: int = attrs.field(default=2048, validator=_positive)
    block_size: int = attrs.field(default=64, validator=_positive)
    compress_ratio: int = attrs.field(default=1, validator=_positive)
    prefill_k_tokens: int = attrs.field(
        default=attrs.Factory(lambda self: max(self.max_model_len // self.compress_ratio, DEFAULT_PREFILL_K_TOKENS),
                              takes_self=True),
        validator=_positive,
    )
    max_logits_bytes: int = attrs.field(default=DEFAULT_MAX_LOGITS_BYTES, validator=_positive)
    max_decode_logits_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    min_prefill_query_len: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    fp8_dtype: torch.dtype = attrs.field(default=torch.float8_e4m3fn, validator=_one_of(*FP8_DTYPES))
    cache_format: CacheFormat | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(CacheFormat)))
    with_qk: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    world_size: int = attrs.field(default=1, validator=_positive)
    logits_dtype: torch.dtype = attrs.field(default=torch.float32, validator=_one_of(*LOGITS_DTYPES))
    compressed_prefill_logits: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    candidate_blocks: int = attrs.field(default=0, validator=_non_negative)
    candidate_block_size: int = attrs.field(default=8, validator=_positive)

    def __attrs_post_init__(self):
        if self.cache_format is not None and self.cache_format.mxfp4 and self.world_size > 1:
            raise ValueError(f"IndexerLimits.cache_format: MXFP4 caches are not supported with context parallel "
                             f"(world_size={self.world_size}): its ranks gather and score FP8 keys")
        if self.candidate_blocks and (self.candidate_blocks - 1) * self.candidate_block_size + 1 < self.topk:
            raise ValueError(
                f"IndexerLimits.candidate_blocks={self.candidate_blocks} blocks of candidate_block_size="
                f"{self.candidate_block_size} cannot hold topk={self.topk} positions with one block partial: "
                f"(candidate_blocks - 1) * candidate_block_size + 1 must be >= topk (docs/spec.md §6a)"
            )
        if self.candidate_blocks and self.world_size > 1 and self.block_size % self.candidate_block_size:
            raise ValueError(f"IndexerLimits.candidate_block_size={self.candidate_block_size} must divide "
                             f"block_size={self.block_size} with context parallel (world_size={self.world_size}): "
                             "each candidate block must lie in one cache block, on one rank (docs/spec.md §11)")
        if self.max_model_len < self.compress_ratio:
            raise ValueError(
                f"IndexerLimits.max_model_len={self.max_model_len} must be >= compress_ratio={self.compress_ratio}: "
                "a request must be able to hold one key"
            )
        if self.prefill_k_tokens < self.max_keys:
            raise ValueError(
                f"IndexerLimits.prefill_k_tokens={self.prefill_k_tokens} must be >= max_keys={self.max_keys} "
                f"(max_model_len // compress_ratio): one request's keys must fit one prefill chunk"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"IndexerLimits.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if self.min_prefill_query_len is not None and self.min_prefill_query_len > self.next_n + 1:
            raise ValueError(
                f"IndexerLimits.min_prefill_query_len={self.min_prefill_query_len} must be <= next_n + 1 = "
                f"{self.next_n + 1} (a request of more than next_n tokens is always a prefill request)"
            )
        if self.logits_dtype != torch.float32 and self.world_size > 1:
            raise ValueError(f"IndexerLimits.logits_dtype={self.logits_dtype} is not supported with context parallel "
                             f"(world_size={self.world_size}): the merge exchanges float32 candidate values")
        if self.compressed_prefill_logits and self.world_size > 1:
            raise ValueError("IndexerLimits.compressed_prefill_logits is not supported with context parallel "
                             f"(world_size={self.world_size}): each rank scores its local keys in full [M, N] rows")
        one = self.next_n * self.max_keys * self.logits_dtype.itemsize
        if self.max_decode_logits_bytes is not None and self.max_decode_logits_bytes < one:
            raise ValueError(
                f"IndexerLimits.max_decode_logits_bytes={self.max_decode_logits_bytes} must hold one decode "
                f"request's logits, next_n * max_keys * {self.logits_dtype.itemsize} = {one} bytes"
            )

    @property
    def cache(self) -> CacheFormat:
        """The K cache's format: ``cache_format``, or ``CacheFormat(fp8_dtype=fp8_dtype)``."""
        return self.cache_format if self.cache_format is not None else CacheFormat(fp8_dtype=self.fp8_dtype)

    @property
    def mxfp4(self) -> bool:
        """Whether the cache and the queries are MXFP4 (docs/spec.md §3a: ``cache_format=CacheFormat(values=
        "mxfp4")``); the gather buffers then hold ``D / 2`` value bytes and ``D / 32`` scale bytes per key."""
        return self.cache_format is not None and self.cache_format.mxfp4

    @property
    def max_keys(self) -> int:
        """Most keys of one request: ``max_model_len // compress_ratio`` (the decode logits' width)."""
        return self.max_model_len // self.compress_ratio

    @property
    def min_prefill_queries(self) -> int:
        """Fewest query tokens of a prefill request: ``min_prefill_query_len``, or ``next_n + 1`` when unset."""
        return self.next_n + 1 if self.min_prefill_query_len is None else self.min_prefill_query_len

    @property
    def max_decode_rows(self) -> int:
        """Rows of decode logits: ``max_num_seqs * next_n``."""
        return self.max_num_seqs * self.next_n

    @property
    def decode_batch(self) -> int:
        """Decode requests scored and selected together: ``max_num_seqs`` without a budget (or when every row
        fits it), else ``max_decode_logits_bytes // (next_n * max_keys * itemsize)`` (4 for float32 logits,
        2 for bfloat16)."""
        per_req = self.next_n * self.max_keys * self.logits_dtype.itemsize
        if self.max_decode_logits_bytes is None:
            return self.max_num_seqs
        return min(self.max_num_seqs, self.max_decode_logits_bytes // per_req)

    @property
    def decode_batch_rows(self) -> int:
        """Rows of one decode sub-batch: ``decode_batch * next_n``."""
        return self.decode_batch * self.next_n

    @property
    def prefill_logits_elems(self) -> int:
        """Cap on ``query_tokens * key_tokens`` of one prefill chunk."""
        return self.max_logits_bytes // 4
