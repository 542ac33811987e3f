#!/usr/bin/env bash
# The test command of the README: the whole suite on the reference backend, then every op test and the
# end-to-end step again with the Triton kernels executed by Triton's CPU interpreter (its own process, since
# TRITON_INTERPRET must be set before triton is imported). GPU tests (marker `gpu`) skip without a GPU.
# pytest's exit code 5 ("no tests collected") counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
fail=0
run() {
  echo "+ $*"
  "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 5 ] && echo "pytest collected no tests (exit 5): failing"
    fail=1
  fi
}
run "$PY" -m pytest -q -p no:cacheprovider --durations=10 tests
run env TRITON_INTERPRET=1 SPARSE_INDEXER_TEST_BACKENDS=triton "$PY" -m pytest -q -p no:cacheprovider \
  tests/sparse_indexer/ops tests/sparse_indexer/test_indexer.py tests/sparse_indexer/test_decode_budget.py \
  tests/sparse_indexer/test_compressed.py tests/sparse_indexer/test_cache_format.py \
  tests/sparse_indexer/test_candidates_step.py tests/sparse_indexer/test_fused_topk.py \
  tests/sparse_indexer/test_indexer_mxfp4.py tests/sparse_indexer/test_mxfp4_tiled.py \
  tests/sparse_indexer/test_hostile_cache_ragged.py tests/sparse_indexer/test_hostile_paged.py \
  tests/sparse_indexer/test_hostile_topk.py
# the vLLM shim on metadata from vLLM's own builder, for DeepSeek-V3.2, V4 and V4.1 (candidate blocks) indexer
# caches (its Triton metadata kernels in the interpreter; vLLM imports triton without a GPU driver only when
# CUDA_VISIBLE_DEVICES is set and empty); skips where vLLM is absent
run env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1 "$PY" -m pytest -q \
  -p no:cacheprovider tests/compat/test_vllm_builder.py tests/compat/test_vllm_builder_v4.py \
  tests/compat/test_vllm_builder_v41.py tests/compat/test_vllm_rocm_mxfp4.py
exit $fail
