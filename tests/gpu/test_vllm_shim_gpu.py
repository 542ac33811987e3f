"""The vLLM shim's padded decode step under a CUDA graph, as vLLM runs it with FULL graphs: captured
from vLLM's uniform capture batch and from a padded one, replayed with new lengths, block tables, slots, queries
and keys; every replay equals the eager op and our own path (tests/compat/vllm_graph.py). The metadata is vLLM
0.33's own builder output (tests/compat/vllm_padded_decode.json): vLLM need not be installed.

DeepSeek-V3.2 (next_n 1 to 3, the op writes the keys) and DeepSeek-V4's compressed indexer (compress ratio 4,
256-token pages of 64 entries, H = 64, D = 128, top-512, next_n 1 and 2: the compressor's keys are in the cache
before the op, ``k=None``).

Run: ``python3 -m pytest -q tests/gpu/test_vllm_shim_gpu.py`` (auto backend: Triton on CUDA).
"""

from __future__ import annotations

import pytest

from tests.compat.vllm_graph import check_padded_decode_replay

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("next_n", [1, 2, 3])
@pytest.mark.parametrize("capture_step", [0, 1], ids=["capture_uniform", "capture_padded"])
def test_padded_decode_graph_replays_like_eager(next_n, capture_step):
    check_padded_decode_replay("cuda", next_n, capture_step)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("capture_step", [0, 1], ids=["capture_uniform", "capture_padded"])
def test_v4_padded_decode_graph_replays_like_eager(next_n, capture_step):
    check_padded_decode_replay("cuda", next_n, capture_step, compress_ratio=4)
