"""A process-wide "the run was asked to stop" flag, read by long work between its batches or
denoising steps: sample grids, FID/KID, held-out loss, the gradient monitor. A grid of
1000 DDIM steps or an FID of 10k images takes minutes, past a scheduler's grace period (Slurm's
KillWait is 30 s), so the work gives up at its next step and the trainer writes its checkpoint.

training/preemption.py sets it from its signal handler and clears it when the loop ends. Work that
gives up raises `StopRequested` before it writes anything.

Several ranks share the work: each samples its part of a grid or of the FID images (uneven parts:
ranks do different numbers of batches), then a gather brings the parts to rank 0; the main
process's work (debug images, held-out loss, gradient monitor, export) runs on rank 0 while the
others wait. A stop must reach every rank and the collectives must still match:
- A collective per batch cannot do it: the ranks do different numbers of batches. Relying on
  every rank's own signal cannot either: a job may signal only some ranks, and torchrun's
  launcher forwards a signal with delays.
- So a rank whose flag is set publishes it: one key in a store every rank reaches (`Shared`;
  preemption.py gives it the default process group's c10d store). `check()` on the other ranks
  asks the store at most every POLL_SECONDS (a round trip to the store's host: 0.035 ms on
  loopback here, a network round trip across nodes) and gives up too.
- Each section of shared work runs in `interruptible()`, on every rank in the same order. It
  ends with one agreement that every rank reaches whether it finished or gave up: if any rank gave
  up or was asked to stop, every rank raises StopRequested there, before the gather or any later
  collective; otherwise all go on. So the collectives always match.
- The agreement waits in Python (polling the store every WAIT_SECONDS), not in a blocking
  collective: a rank that finished its part and waits for the others still runs its signal handler
  at once and publishes, where one blocked in a C++ collective would only see its signal once the
  others had finished their work.
- Only the host and the store are involved: no device tensor is read, so no host sync.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # what schedulers and Ctrl-C send
_requested = threading.Event()
_early: tuple[str, float] | None = None  # the first stop signal before the loop: (name, time.monotonic())
POLL_SECONDS = 0.5   # check() asks the store whether another rank stopped at most this often (a round trip)
WAIT_SECONDS = 0.01  # the agreement's poll interval while it waits for the other ranks


def record_early_signals() -> dict:
    """From the first line of the command on, a stop signal is recorded instead of killing the
    process: Slurm may signal a job while it imports torch or builds its data (seen here with
    `--time=1 --signal=USR1@40`: the signal came 20 s in). The loop's watch (training/preemption.py)
    takes it over and stops after the first step with a checkpoint. Returns the handlers it
    replaced, for `reset` ({} off the main thread, where Python sets no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {number: signal.signal(number, _record_early) for number in STOP_SIGNALS}


def reset(previous_handlers: dict) -> None:
    """The process as before record_early_signals: its handlers back, no signal on record, no stop
    requested or shared. A command's main() calls it on every exit, so that a program (a notebook, a
    test) that runs it keeps its own Ctrl-C and can run it again."""
    global _early
    for number, handler in previous_handlers.items():
        signal.signal(number, handler)
    _early = None
    clear()


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


class Shared:
    """The flag across the `num_ranks` ranks of a launch, through a c10d store (its set, check, add
    and delete_key; every rank makes one on the same store, with the same prefix)."""

    def __init__(self, store, rank: int, num_ranks: int):
        self.store, self.rank, self.num_ranks = store, rank, num_ranks
        self.sections = 0           # interruptible sections ended: every rank counts the same
        self.published = False
        self.last_poll = -POLL_SECONDS

    def publish(self) -> None:
        if not self.published:
            self.store.set("stop", "1")
            self.published = True

    def poll(self) -> bool:
        """Whether a rank has published a stop; asks the store at most every POLL_SECONDS."""
        now = time.monotonic()
        if now - self.last_poll < POLL_SECONDS:
            return False
        self.last_poll = now
        self.published = self.published or self.store.check(["stop"])
        return self.published

    def agree(self, gave_up: bool) -> bool:
        """Every rank calls it at the end of each section: True on all of them if any gave up."""
        self.sections += 1
        section = f"section{self.sections}"
        if gave_up:  # published, so ranks still at work give up; counted before this rank arrives
            self.publish()
            self.store.add(f"{section}/gave_up", 1)
        arrived = self.store.add(f"{section}/arrived", 1)
        while arrived < self.num_ranks:
            time.sleep(WAIT_SECONDS)  # a signal now runs the handler at once; publish it
            if _requested.is_set():
                self.publish()
            arrived = self.store.add(f"{section}/arrived", 0)
        agreed = self.store.add(f"{section}/gave_up", 0) > 0
        if self.rank == 0 and self.sections > 1:  # every rank has read the previous section's keys
            for key in ("gave_up", "arrived"):
                self.store.delete_key(f"section{self.sections - 1}/{key}")
        return agreed


_shared: Shared | None = None


def share(shared: Shared | None) -> None:
    """With several ranks: publish and learn stops through `shared` (None: this process alone)."""
    global _shared
    _shared = shared


def request() -> None:
    _requested.set()


def clear() -> None:
    _requested.clear()
    share(None)


def check() -> None:
    """Raise StopRequested if a stop was requested, here or (with several ranks) on another rank:
    call between batches or denoising steps, inside `interruptible()` where ranks share the work."""
    if not _requested.is_set() and _shared is not None and _shared.poll():
        _requested.set()
    if _requested.is_set():
        if _shared is not None:
            _shared.publish()
        raise StopRequested("the run was asked to stop")


@contextlib.contextmanager
def interruptible():
    """A section of work that may give up (StopRequested inside it); every rank of a launch enters
    the same sections in the same order. It ends with one agreement: StopRequested on every rank if
    any gave up or was asked to stop, nothing otherwise."""
    gave_up = False
    try:
        yield
    except StopRequested:
        gave_up = True
    gave_up = gave_up or _requested.is_set()
    if _shared is not None:
        gave_up = _shared.agree(gave_up)
    if gave_up:
        raise StopRequested("the run was asked to stop")
