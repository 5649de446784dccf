"""The trainer with test-only failure injection through its extension points
(diffusion_extras.training.hooks), driven by environment variables:

DDPM_TEST_STOP_AFTER_STEP=N   the process dies (os._exit, no export) right after checkpoint N is saved:
                              a run cut off by pre-emption at a checkpoint boundary.
DDPM_TEST_SIGKILL_IN_SAVE=N   SIGKILL while checkpoint N is being completed (files written, no marker yet).
DDPM_TEST_NAN_AT_STEPS=a,b    the model inputs of those optimizer steps (1-based) are NaN.
DDPM_TEST_SLOW_SET_EPOCH=S    datasets' set_epoch waits S seconds between its read and its write of the
                              shared epoch (conftest.slow_set_epoch): DataLoader workers race on it.
                              (A patch of the datasets library in this test process, not of the trainer.)
"""
import os
import signal
import sys

from diffusion_extras.training.main import Hooks, main


def hooks_from_environment(environ) -> Hooks:
    hooks = Hooks()
    stop_after = environ.get("DDPM_TEST_STOP_AFTER_STEP")
    kill_in_save = environ.get("DDPM_TEST_SIGKILL_IN_SAVE")
    nan_steps = environ.get("DDPM_TEST_NAN_AT_STEPS")
    if stop_after:
        def die_after(run, path):
            if run.progress.global_step == int(stop_after):
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(0)
        hooks.after_checkpoint = die_after
    if kill_in_save:
        def kill_before_marker(directory):
            if os.path.basename(directory) == f".checkpoint-{kill_in_save}.tmp":
                os.kill(os.getpid(), signal.SIGKILL)
        hooks.before_checkpoint_marker = kill_before_marker
    if nan_steps:
        poisoned = {int(step) for step in nan_steps.split(",")}

        def poison(run, clean, micro_step):
            optimizer_step = micro_step // run.config.gradient_accumulation_steps + 1
            return clean * float("nan") if optimizer_step in poisoned else clean
        hooks.model_input = poison
    return hooks


def slow_down_set_epoch(environ) -> None:
    seconds = environ.get("DDPM_TEST_SLOW_SET_EPOCH")
    if seconds:
        import datasets
        from conftest import slow_set_epoch
        datasets.IterableDataset.set_epoch = slow_set_epoch(float(seconds))


if __name__ == "__main__":
    slow_down_set_epoch(os.environ)
    sys.exit(main(hooks=hooks_from_environment(os.environ)))
