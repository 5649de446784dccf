"""Preemption: SIGTERM, SIGUSR1 (what Slurm's `--signal` sends) or SIGINT (Ctrl-C,
which a terminal sends to the whole process group) stops the run at the end of the current optimizer
step with a checkpoint at that step, one line, and exit code 4.

The handler only records the signal; the loop asks `requested()` once per step, after the step.
With several ranks (torch.distributed.run forwards SIGTERM to each, but not at the same instant,
and a job may signal only some) they must agree on the stop step, so `requested()` all-reduces
(max) a one-element CPU tensor on a gloo group of its own. Why this and not the alternatives:
- at the logging-window boundary only: no cost, but a window can outlast a 30-s grace period;
- a device flag in the step: reading it is a host sync per step (tests/test_host_sync.py);
- gloo on CPU: no CUDA stream is touched, so the GPU queue is not drained; the cost is one
  loopback round trip per step (~0.1 ms on one node, a network round trip across nodes), while
  the ranks already meet at every step's gradient all-reduce. One rank alone needs no collective.
Work between steps (grids, FID/KID, held-out loss, the gradient monitor) gives up at its next batch
or denoising step through core/stop_flag.py, which the handler sets; with several ranks that flag
is shared through the default process group's store (its docstring says how the ranks agree).
A second signal (while the checkpoint is written) only finds the flag already set: it is ignored,
so the save finishes; the atomic save would keep `checkpoint-N` whole even if it did not.
"""
from __future__ import annotations

import itertools
import signal
import threading
import time

import torch

from diffusion_extras.core import stop_flag
from diffusion_extras.core.stop_flag import STOP_SIGNALS
from diffusion_extras.training.stops import Preempted

SIGNALS = STOP_SIGNALS  # the loader workers ignore the same ones (data/workers.py): a job signals them all
_watches = itertools.count()  # a store prefix per watch: every rank makes its watches in the same order


class PreemptionWatch:
    """Records SIGTERM/SIGUSR1/SIGINT from construction until `close()` (the loop's lifetime): the
    end-of-run work after the last step runs with the previous handlers."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.received: str | None = None      # the first signal's name
        self.received_at: float | None = None  # time.monotonic() when it came
        self.group = None
        if accelerator.num_processes > 1 and torch.distributed.is_initialized():
            from datetime import timedelta

            from diffusion_extras.training.build import COLLECTIVE_TIMEOUT_MINUTES  # made the accelerator: loaded

            # collective: every rank makes it. Its own timeout, or torch gives it gloo's default
            # rather than the process group's.
            self.group = torch.distributed.new_group(backend="gloo",
                                                     timeout=timedelta(minutes=COLLECTIVE_TIMEOUT_MINUTES))
            store = torch.distributed.PrefixStore(f"ddpm_stop/{next(_watches)}",
                                                  torch.distributed.distributed_c10d._get_default_store())
            stop_flag.share(stop_flag.Shared(store, accelerator.process_index, accelerator.num_processes))
        if stop_flag.early_signal() is not None:  # came during start-up: stop after the first step
            self._record(signal.Signals[stop_flag.early_signal()[0]], None)
            self.received_at = stop_flag.early_signal()[1]
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self.previous = {number: signal.signal(number, self._record) for number in SIGNALS}
            for number in SIGNALS:
                # Python installs handlers without SA_RESTART: a system call in C++ code (a gloo or
                # NCCL socket read inside a collective, a file write in a save) would fail with EINTR
                # when the scheduler's signal lands in it. Restarted instead, it finishes, and the
                # flag is read after the step.
                signal.siginterrupt(number, False)

    def _record(self, number, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(number).name, time.monotonic()
            stop_flag.request()  # grids and evaluations give up, on every rank (core/stop_flag.py)

    def requested(self) -> bool:
        """True on every rank at the same step once any rank has received a signal."""
        if self.group is None:
            return self.received is not None
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.numpy()[0])  # a CPU tensor: no device sync

    def stopped(self, step: int, checkpoint: str) -> Preempted:
        """The exception the loop raises once the checkpoint at `step` is complete."""
        what = self.received or "a stop signal (on another rank)"
        since = f", {time.monotonic() - self.received_at:.1f} s after it" if self.received_at else ""
        return Preempted(f"preempted: {what} received; stopped after optimizer step {step} with checkpoint "
                         f"{checkpoint}{since}. Continue with the same command and --resume_from_checkpoint latest",
                         announce=self.accelerator.is_main_process)

    def close(self) -> None:
        stop_flag.clear()  # and no longer shared
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}
