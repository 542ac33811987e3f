"""The commands of ``python -m sparse_indexer``: ``demo``, ``check`` (the self-check), ``plan``, ``bench`` (device
and host benchmarks, kernel sweeps) and ``profile`` (the worst-case steps of a plan and the memory they add).
They use the public API only; nothing in the library imports them.
"""
