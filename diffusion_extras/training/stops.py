"""The ways a run stops before its last step with its state saved. Each carries the exit code
train_ddpm.py returns (main.py lists them) and a one-line message saying why and how to go on."""
from __future__ import annotations


class RunStopped(RuntimeError):
    exit_code = 1
    prefix = "error: "  # printed before the message

    def __init__(self, message: str, announce: bool = True):
        super().__init__(message)
        self.announce = announce  # False on the ranks that leave the one line to the main process


class NonFiniteStop(RunStopped):
    """Too many consecutive non-finite steps: the run stops with its last good weights saved."""
    exit_code = 3
    prefix = "error: stopped: "


class Preempted(RunStopped):
    """Stopped on a signal with a checkpoint at the stop step (preemption.py)."""
    exit_code = 4  # not 143 (128 + SIGTERM): that also reads "killed by SIGTERM, nothing saved"
    prefix = ""


class DiskFull(RunStopped):
    """A write of the output folder did not (or would not) fit; the message says what to free (disk_space.py)."""
    exit_code = 5
