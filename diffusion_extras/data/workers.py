"""DataLoader worker processes and the scheduler's stop signals.

A job scheduler signals every process of the job, not only the trainer: Slurm's `--signal`,
`scancel` and the time limit reach each process of the step, and Ctrl-C reaches the terminal's
whole process group. A loader worker left with the default action dies of SIGTERM/SIGUSR1
("DataLoader worker (pid ...) is killed by signal") and takes the run down before it can save;
on SIGINT torch's worker loop exits quietly, with the same result. Workers own nothing
worth saving, so they ignore these signals from anyone but their parent; the main process, which
records them (training/preemption.py), stops the run at a step boundary and ends its workers itself.

Why not SIG_IGN: the parent ends its workers with SIGTERM too (multiprocessing's exit handler
terminates daemonic children and joins them; torch's loader does so when a worker does not leave
in time), and a worker that ignores that never exits: the run hangs after "done". A Python handler
cannot see who sent a signal, so the worker blocks the signals (from its fork on: start_workers)
and a thread of its own takes them with sigwaitinfo, which names the sender (written by hand:
neither torch nor multiprocessing offers a worker that tells a scheduler's signal from its parent's).
"""
from __future__ import annotations

import os
import signal
import threading

from diffusion_extras.core.stop_flag import STOP_SIGNALS


def start_workers(loader):
    """`iter(loader)` with the stop signals blocked in this thread while it forks the workers, so
    each worker starts with them blocked and every thread it makes inherits that; the thread that
    ignore_stop_signals starts takes them. Blocking them in worker_init_fn alone came too late:
    threads a worker made before it kept them unblocked, torch's worker SIGTERM handler ran in one
    of them and the worker died of a scheduler's SIGTERM (seen on a two-node local Slurm with
    OMP_NUM_THREADS unset). Meanwhile a signal to this process waits, or goes to another of its
    threads, where Python's handler still records it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def closable(iterator):
    """`iterator` (a DataLoader's, started) as a generator whose close() drops it (a closed
    generator frees its frame): torch ends the workers when it frees their iterator, and this
    generator holds the only reference."""
    yield from iterator


def ignore_stop_signals(worker_id: int) -> None:
    """`worker_init_fn` of every loader of training data: the worker ignores the stop signals
    unless its parent sends them. (Forked workers run the main process's handler, which only sets
    a flag, until this runs.)"""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before any thread: they inherit the mask
    threading.Thread(target=_exit_when_the_parent_asks, args=(os.getppid(),), daemon=True,
                     name="stop-signals").start()


def _exit_when_the_parent_asks(parent: int) -> None:
    while True:
        received = signal.sigwaitinfo(STOP_SIGNALS)
        if received.si_pid == parent:  # the loader's or multiprocessing's shutdown
            # Exit 0, as torch's own worker SIGTERM handler does when its parent sends it: the main
            # process's SIGCHLD check (torch's _error_if_any_worker_fails) takes any other exit code
            # as a failed worker and raises at interpreter exit (seen: "exited unexpectedly with
            # exit code 143" after "done" on the local Slurm, where 143 was 128 + SIGTERM).
            os._exit(0)
