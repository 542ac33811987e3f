"""The fused decode top-k's global scratch (imports nothing of the package: the registry and the plan read it).

Row ``r`` of the int32 workspace ``[>= B * next_n, FUSED_WORKSPACE_COLS]`` holds the radix select's three
global histograms of row ``r`` (2048, 2048 and 1024 bins: the key's top 11 bits, the next 11, the last 10) and
8 counters (output slots taken, tickets of the final tie class, the rest unused). The kernel zeroes the rows it
uses at the start of each call, so the contents before and after a call are undefined.
"""

HIST_BINS = (2048, 2048, 1024)
COUNTERS = 8
FUSED_WORKSPACE_COLS = sum(HIST_BINS) + COUNTERS
"""int32 columns per row: 5128."""
