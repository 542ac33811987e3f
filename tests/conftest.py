"""Shared test configuration.

Backends under test come from ``SPARSE_INDEXER_TEST_BACKENDS`` (comma separated, default ``reference``).
CI runs the suite twice: once as is, once with ``TRITON_INTERPRET=1 SPARSE_INDEXER_TEST_BACKENDS=triton`` in its
own pytest process, so every Triton kernel executes on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

BACKENDS = tuple(b for b in os.environ.get("SPARSE_INDEXER_TEST_BACKENDS", "reference").split(",") if b)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config):
    torch.manual_seed(0)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The backend under test (see the module docstring)."""
    return request.param


@pytest.fixture
def device():
    """The device the op tests run on: the GPU under the ``gpu`` marker, else the CPU."""
    return "cpu"


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
