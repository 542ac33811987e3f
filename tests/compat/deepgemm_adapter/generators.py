"""DeepGEMM's ``tests/generators.py`` names, imported at the top of its attention test. They build inputs of
its GEMM tests, which need DeepGEMM's GEMM kernels (not part of sparse-indexer): calling one raises."""


class MajorTypeAB:  # noqa: D101 - DeepGEMM's enum of operand layouts
    KMajor = "k"
    MNMajor = "mn"


def _gemm_only(*args, **kwargs):
    raise NotImplementedError("DeepGEMM's GEMM tests are out of scope of the sparse-indexer adapter")


generate_normal = get_ue8m0_usage = get_kernel_types = _gemm_only
