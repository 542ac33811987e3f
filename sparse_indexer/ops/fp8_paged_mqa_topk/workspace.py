"""The fused decode top-k's global scratch (imports nothing of the package: the registry and the plan read it).

Row ``r`` of the int32 workspace ``[>= B * next_n, FUSED_WORKSPACE_COLS]`` holds, for row ``r``:

- the histogram of the keys' top 11 bits (2048 bins);
- either the two histograms of the later digits (2048 and 1024 bins: the next 11 bits, the last 10), for a row
  whose threshold bin holds more than ``LIST_CAP`` cells, or, over the same columns and beyond, the row's list of
  the threshold bin's cells (``LIST_CAP`` keys, then ``LIST_CAP`` positions);
- 8 counters (output slots taken, tickets of a tie class, list entries taken, cells done; the rest unused).

The kernel zeroes what it counts in at the start of each call, so the contents before and after a call are
undefined.
"""

HIST_BINS = (2048, 2048, 1024)
LIST_CAP = 4096
COUNTERS = 8
FUSED_WORKSPACE_COLS = HIST_BINS[0] + 2 * LIST_CAP + COUNTERS
"""int32 columns per row: 10248."""
