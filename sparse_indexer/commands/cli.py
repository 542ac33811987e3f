"""Shared pieces of the command line (``python -m sparse_indexer ...``): device and backend resolution with
one-line errors, and progress output that only goes to a terminal."""

from __future__ import annotations

import sys

import torch

from .._runtime import dispatch as _dispatch

__all__ = ["UsageError", "resolve_device", "require_backend", "run_command", "Progress"]


class UsageError(Exception):
    """A device or backend the command cannot use: printed as one line, exit status 2, before any work."""


def run_command(run, args) -> int:
    """``run(args)``'s exit status, or 2 with the :class:`UsageError` printed as one line on stderr."""
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when a GPU is visible, else ``cpu``; otherwise the named device, which must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        why = str(e).split(" device type")[0]
        raise UsageError(f"--device {name!r} is not a device name (cpu, cuda, cuda:N): {why}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"ROCm {torch.version.hip}" if torch.version.hip else (
                f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only")
            raise UsageError(f"--device {name}: no CUDA/ROCm GPU is visible (torch {torch.__version__}, built for "
                             f"{build}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise UsageError(f"--device {name}: sparse-indexer runs on cpu or cuda (CUDA/ROCm) devices")
    return dev


def require_backend(backend: str | None, device: torch.device) -> None:
    """Raise :class:`UsageError` unless ``backend`` (``None``/``"auto"`` = pick the best) can run on ``device``."""
    if backend in (None, "auto"):
        return
    why = _dispatch.unavailable_reason(backend, device)
    if why is not None:
        raise UsageError(f"--backend {backend}: {why}")


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal (no ``\\r`` in redirected output)."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.width = total, width
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, i: int, msg: str = "") -> None:
        if not self.enabled:
            return
        fill = int(self.width * i / max(1, self.total))
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {i}/{self.total} {msg:<60}")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar (before printing a result line)."""
        if self.enabled:
            self.stream.write("\r" + " " * (self.width + 80) + "\r")
            self.stream.flush()
