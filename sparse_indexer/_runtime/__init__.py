"""The runtime under the public functions: nothing here is public API.

- ``launch``, ``tma``, ``triton_compat``: what the kernels need to launch (bound Triton launches, cached TMA
  descriptors, work-arounds for the supported Triton releases, whether Triton's interpreter runs).
- ``checks``: argument checks shared by the public functions (shapes, dtypes, devices, windows, overlaps).
- ``dispatch``: resolution of ``backend=`` against the registry in ``sparse_indexer.backends``.
- ``library``: the ``torch.library`` custom ops and their fakes, and the direct eager path.
"""
