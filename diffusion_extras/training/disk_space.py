"""A full disk is an error with a remedy, not a crash: exit code 5 and one line saying
which folder, how much is free, how much is needed, the newest complete checkpoint, and how to go on.

Two guards: before each checkpoint, the free space of output_dir against the size of the newest
checkpoint (or an estimate); and around each write of the output folder (checkpoint, pipeline
export, sample grid, history), an ENOSPC that still happens removes that write's partial files.
Nothing written before is touched: older checkpoints and the previous export stay as they were.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil

from diffusion_extras.training import checkpointing
from diffusion_extras.training.stops import DiskFull


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def checkpoint_size(path: str) -> int:
    """Bytes of a complete checkpoint, as its completion marker lists them."""
    with open(os.path.join(path, checkpointing.MARKER)) as fh:
        return sum(json.load(fh)["files"].values())


def estimated_checkpoint_size(parameters, ema_copies: int) -> int:
    """Before the first checkpoint: weights + Adam's two moments + each EMA copy, in the
    parameters' dtype (the RNG, schedule and diagnostics files are small next to these)."""
    parameter_bytes = sum(p.numel() * p.element_size() for p in parameters)
    return parameter_bytes * (3 + ema_copies)


def newest_checkpoint(output_dir: str) -> str:
    found = checkpointing.list_checkpoints(output_dir)
    return found[-1] if found else "none yet"


def resume_instruction(output_dir: str) -> str:
    return ("then resume with --resume_from_checkpoint latest" if checkpointing.list_checkpoints(output_dir)
            else "then run the same command again (no checkpoint to resume from yet)")


def remedy(output_dir: str) -> str:
    return f"Free space in {output_dir} (or move older checkpoints elsewhere), {resume_instruction(output_dir)}"


def space_shortfall(output_dir: str, step: int, needed: int, basis: str) -> str | None:
    """None when `needed` bytes fit in output_dir; else the one-line refusal with the numbers."""
    free = shutil.disk_usage(output_dir).free
    if needed <= free:
        return None
    return (f"not enough disk space for checkpoint-{step} in {output_dir}: {megabytes(free)} free, "
            f"{megabytes(needed)} needed ({basis}); nothing was written. Newest complete checkpoint: "
            f"{newest_checkpoint(output_dir)}. {remedy(output_dir)}")


def check_checkpoint_space(accelerator, output_dir: str, step: int, parameters, ema_copies: int) -> None:
    """Refuse the checkpoint at `step` (DiskFull on every rank) when it cannot fit. The main process
    measures, and with several ranks broadcasts its verdict (one small collective per checkpoint,
    beside the save's own barriers) so that every rank stops at the same point."""
    verdict = None
    if accelerator.is_main_process:
        found = checkpointing.list_checkpoints(output_dir)
        if found:
            needed, basis = checkpoint_size(found[-1]), f"the size of {os.path.basename(found[-1])}"
        else:
            needed, basis = estimated_checkpoint_size(parameters, ema_copies), "estimated from the parameters"
        verdict = space_shortfall(output_dir, step, needed, basis)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        verdict = broadcast_object_list([verdict])[0]
    if verdict:
        raise DiskFull(verdict, announce=accelerator.is_main_process)


def full_disk_message(what: str, output_dir: str, removed: list[str]) -> str:
    free = megabytes(shutil.disk_usage(output_dir).free) if os.path.isdir(output_dir) else "unknown"
    found = checkpointing.list_checkpoints(output_dir)
    needed = f"; a checkpoint here takes {megabytes(checkpoint_size(found[-1]))}" if found else ""
    cleaned = f"; removed the partial {', '.join(removed)}" if removed else ""
    return (f"no space left on the device while writing the {what} in {output_dir} ({free} free{needed}){cleaned}. "
            f"Everything written before is kept; newest complete checkpoint: {newest_checkpoint(output_dir)}. "
            f"{remedy(output_dir)}")


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def _remove(path: str) -> bool:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
    else:
        return False
    return True


@contextlib.contextmanager
def guarded_write(what: str, output_dir: str, partial=(), before_write=None):
    """Run a write of the output folder; on ENOSPC (or a full quota) remove `partial` (its temporary
    files) and raise DiskFull. `before_write(what)` is the test hook (hooks.Hooks.before_write)."""
    try:
        if before_write is not None:
            before_write(what)
        yield
    except OSError as error:
        if not is_disk_full(error):
            raise
        removed = [path for path in partial if _remove(path)]
        raise DiskFull(full_disk_message(what, output_dir, removed)) from None
