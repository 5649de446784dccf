"""train_ddpm.py with test-only failure injection, driven by environment variables:

DDPM_TEST_STOP_AFTER_STEP=N   the process dies (os._exit, no export) right after checkpoint N is saved:
                              a run cut off by pre-emption at a checkpoint boundary.
DDPM_TEST_SIGKILL_IN_SAVE=N   SIGKILL while checkpoint N is being completed (files written, no marker yet).
DDPM_TEST_NAN_AT_STEPS=a,b    the model inputs of those optimizer steps (1-based) are NaN.
DDPM_TEST_SLOW_SET_EPOCH=S    datasets' set_epoch waits S seconds between its read and its write of the
                              shared epoch (conftest.slow_set_epoch): DataLoader workers race on it.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_ddpm  # noqa: E402
from diffusion_extras.training import checkpointing  # noqa: E402

stop_after = os.environ.get("DDPM_TEST_STOP_AFTER_STEP")
kill_in_save = os.environ.get("DDPM_TEST_SIGKILL_IN_SAVE")

if stop_after:
    original_save = train_ddpm.save_checkpoint

    def save_then_die(run):
        original_save(run)
        if run.progress.global_step == int(stop_after):
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
    train_ddpm.save_checkpoint = save_then_die

if kill_in_save:
    original_fsync_tree = checkpointing._fsync_tree

    def fsync_then_kill(directory):
        if os.path.basename(directory) == f".checkpoint-{kill_in_save}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
        return original_fsync_tree(directory)
    checkpointing._fsync_tree = fsync_then_kill

nan_steps = os.environ.get("DDPM_TEST_NAN_AT_STEPS")

if nan_steps:
    poisoned = {int(step) for step in nan_steps.split(",")}
    original_forward_backward, original_input = train_ddpm.forward_backward, train_ddpm.data.to_model_input

    def poisoned_forward_backward(run, batch, micro_step, sync):
        if micro_step // run.config.gradient_accumulation_steps + 1 in poisoned:
            train_ddpm.data.to_model_input = lambda *a, **k: original_input(*a, **k) * float("nan")
        try:
            return original_forward_backward(run, batch, micro_step, sync)
        finally:
            train_ddpm.data.to_model_input = original_input
    train_ddpm.forward_backward = poisoned_forward_backward

slow_set_epoch = os.environ.get("DDPM_TEST_SLOW_SET_EPOCH")

if slow_set_epoch:
    import datasets
    from conftest import slow_set_epoch as make_slow_set_epoch
    datasets.IterableDataset.set_epoch = make_slow_set_epoch(float(slow_set_epoch))

if __name__ == "__main__":
    sys.exit(train_ddpm.main())
