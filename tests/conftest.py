"""Shared test configuration.

Backends under test come from ``SPARSE_INDEXER_TEST_BACKENDS`` (comma separated, default ``reference``); each must
be in the backend registry (:mod:`sparse_indexer.backends`), a registered one included. CI runs the suite twice:
once as is, once with ``TRITON_INTERPRET=1 SPARSE_INDEXER_TEST_BACKENDS=triton`` in its own pytest process, so
every Triton kernel executes on the CPU through Triton's interpreter.

A test taking the ``backend`` fixture calls these ops with it: the op of its module
(``tests/sparse_indexer/ops/test_<op>.py``), or the ops of its ``uses_ops`` marker, or (anywhere else, e.g. the
step) every op. It is skipped for a backend that does not implement them all (the registry's ``ops``).
"""

from __future__ import annotations

import os

import pytest
import torch

from sparse_indexer import backends as registry

BACKENDS = tuple(b for b in os.environ.get("SPARSE_INDEXER_TEST_BACKENDS", "reference").split(",") if b)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config):
    torch.manual_seed(0)
    config.addinivalue_line("markers", "uses_ops(*ops): the ops a test calls with the backend under test "
                            "(none given: every op)")
    unknown = [b for b in BACKENDS if b not in registry.names()]
    if unknown:
        raise pytest.UsageError(f"SPARSE_INDEXER_TEST_BACKENDS names unknown backends {unknown}; "
                                f"registered: {registry.names()}")


def ops_of(item) -> tuple[str, ...]:
    """The ops ``item`` (a test) calls with the backend under test (see the module docstring)."""
    marker = item.get_closest_marker("uses_ops")
    if marker is not None:
        return tuple(marker.args) or registry.OPS
    module = item.path.stem.removeprefix("test_")
    return (module,) if module in registry.OPS else registry.OPS


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The backend under test (see the module docstring); skipped where it lacks an op the test calls."""
    entry = registry.get(request.param)
    missing = [op for op in ops_of(request.node) if not entry.implements(op)]
    if missing:
        pytest.skip(f"backend {request.param!r} does not implement {', '.join(missing)}")
    return request.param


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
