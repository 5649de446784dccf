"""A process-wide "the run was asked to stop" flag, read by long work between its batches or
denoising steps (issue 33): sample grids, FID/KID, held-out loss, the gradient monitor. A grid of
1000 DDIM steps or an FID of 10k images takes minutes, past a scheduler's grace period (Slurm's
KillWait is 30 s), so the work gives up at its next step and the trainer writes its checkpoint.

training/preemption.py sets it from its signal handler (one process only: with several ranks the
work holds collectives that every rank must reach, so it runs to its end there) and clears it
when the loop ends. Work that gives up raises `StopRequested` before it writes anything.
"""
from __future__ import annotations

import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # what schedulers and Ctrl-C send
_requested = threading.Event()
_early: tuple[str, float] | None = None  # the first stop signal before the loop: (name, time.monotonic())


def record_early_signals() -> None:
    """From the first line of the command on, a stop signal is recorded instead of killing the
    process: Slurm may signal a job while it imports torch or builds its data (seen here with
    `--time=1 --signal=USR1@40`: the signal came 20 s in). The loop's watch (training/preemption.py)
    takes it over and stops after the first step with a checkpoint."""
    if threading.current_thread() is threading.main_thread():
        for number in STOP_SIGNALS:
            signal.signal(number, _record_early)


def ignore_at_exit() -> None:
    """Once the command's work is over (any exit code, its state on disk), stop signals are ignored:
    a scheduler's signal during interpreter shutdown (loader workers joined, trackers closed) would
    otherwise kill the finished process, since Python resets its handlers to the default action
    while it finalizes, and a job script would see "killed by SIGUSR1" (exit 138) instead of 0.
    Seen on the local Slurm with --signal=USR1@40 on the segment that finished the run. Process
    entry points only: in a test process it would leave Ctrl-C ignored."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def _record_early(number, frame) -> None:
    global _early
    if _early is None:
        _early = (signal.Signals(number).name, time.monotonic())


def early_signal() -> tuple[str, float] | None:
    return _early


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
