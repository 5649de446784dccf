"""A process-wide "the run was asked to stop" flag, read by long work between its batches or
denoising steps (issue 33): sample grids, FID/KID, held-out loss, the gradient monitor. A grid of
1000 DDIM steps or an FID of 10k images takes minutes, past a scheduler's grace period (Slurm's
KillWait is 30 s), so the work gives up at its next step and the trainer writes its checkpoint.

training/preemption.py sets it from its signal handler (one process only: with several ranks the
work holds collectives that every rank must reach, so it runs to its end there) and clears it
when the loop ends. Work that gives up raises `StopRequested` before it writes anything.
"""
from __future__ import annotations

import threading

_requested = threading.Event()


class StopRequested(Exception):
    """Raised between batches/steps of interruptible work once a stop was requested."""


def request() -> None:
    _requested.set()


def clear() -> None:
    _requested.clear()


def check() -> None:
    """Raise StopRequested if a stop was requested: call between batches or denoising steps."""
    if _requested.is_set():
        raise StopRequested("the run was asked to stop")
