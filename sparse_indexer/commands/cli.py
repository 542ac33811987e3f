"""Shared pieces of the command line (``python -m sparse_indexer ...``): device and backend resolution with
one-line errors, Triton's CPU interpreter switched on where a command runs Triton kernels on the CPU, and
progress output that only goes to a terminal."""

from __future__ import annotations

import os
import sys

import torch

from .._runtime import dispatch as _dispatch
from .._runtime.triton_compat import interpreting

__all__ = ["UsageError", "resolve_device", "auto_device_note", "require_backend", "run_command",
           "use_triton_interpreter", "Progress"]


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


def auto_device_note(name: str, device: torch.device) -> str:
    """What ``--device NAME`` resolved to, for a command's first line: ``"cpu (--device auto: no GPU visible)"``,
    ``"cuda:0 (--device auto: a GPU is visible)"``, or the device alone when it was named."""
    if name != "auto":
        return str(device)
    why = "a GPU is visible" if device.type == "cuda" else "no GPU visible"
    return f"{device} (--device auto: {why})"


def use_triton_interpreter(device: torch.device) -> str | None:
    """Switch on Triton's CPU interpreter for a command that runs Triton kernels on ``device`` when it is the CPU.

    ``TRITON_INTERPRET`` is read when triton is imported, so it is set here for this process (and its children)
    only while triton is not imported yet (``python -m sparse_indexer`` imports it later); afterwards the Triton
    backend stays unavailable on the CPU and the command reports that as usual. Returns a note for the command's
    output (``None``: not the CPU, or too late to switch)."""
    if device.type != "cpu":
        return None
    if interpreting():
        return "TRITON_INTERPRET=1 (Triton kernels run in its CPU interpreter)"
    if "triton" in sys.modules:
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    return "TRITON_INTERPRET=1 set for this process (Triton kernels run in its CPU interpreter)"


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
