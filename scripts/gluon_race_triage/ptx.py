"""Compile ``ws_with_reduction.k2`` (with ``gl.warp_specialize``) for sm_90 without a GPU (Triton >= 3.6's bundled
ptxas) and print its shared-memory accesses and barriers: the warp-specialize state word the partitions hand over
(``st.shared.b32 [global_smem+16]`` by the default warps, ``ld.shared.b8 [..+12]`` by the worker) and the CTA-wide
``barrier.sync 1`` between every write and read of it, beside the prologue reduction's ``bar.sync 0, 128``.

    PYTHONPATH=<triton 3.6> python scripts/gluon_race_triage/ptx.py
"""

import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_with_reduction as m  # noqa: E402

src = GluonASTSource(m.k2, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "z_ptr": "*fp32", "c_ptr": "*i32",
                                      "N": "constexpr", "WS": "constexpr"}, constexprs={"N": 128, "WS": True})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(f"shared memory: {k.metadata.shared} bytes")
for i, line in enumerate(k.asm["ptx"].splitlines(), 1):
    if re.search(r"bar\.sync|barrier\.sync|st\.shared|ld\.shared|^\$L__BB|setmaxnreg|brx\.idx", line):
        print(f"{i:5d} {line.strip()}")
