"""The fused decode top-k's global scratch (imports nothing of the package: the registry and the plan read it).

Row ``r`` of the int32 workspace ``[>= B * next_n, FUSED_WORKSPACE_COLS]`` holds, for row ``r``:

- the keys of the row's sample (``SAMPLE_TILES`` tiles of 64 cells);
- the row's list of the cells above its threshold (``LIST_CAP`` keys, then ``LIST_CAP`` positions) and the
  positions of the first ``TIE_CAP`` cells equal to it;
- 8 counters (cells above the threshold, cells equal to it, sample tiles done, cells done; the rest unused).

The kernel zeroes its counters at the start of each call, so the contents before and after a call are
undefined.
"""

SAMPLE_TILES = 32
LIST_CAP = 6144
TIE_CAP = 2048
COUNTERS = 8
FUSED_WORKSPACE_COLS = SAMPLE_TILES * 64 + 2 * LIST_CAP + TIE_CAP + COUNTERS
"""int32 columns per row: 16392."""
