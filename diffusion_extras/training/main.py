"""The trainer's entry: parse the config, set up, train; exit codes a job script can test.

    0  done (or the LR range test written)
    2  bad input: a one-line error before training (config, data, checkpoint)
    3  stopped: too many consecutive non-finite steps, with the last good weights saved
    4  preempted: SIGTERM or SIGUSR1 (Slurm's --signal) stopped the run after the current step,
       with a checkpoint there: requeue and resume with --resume_from_checkpoint latest (preemption.py)
    5  disk full: a checkpoint would not fit, or a write met ENOSPC; its partial files removed,
       everything older kept: free space and resume (disk_space.py)
Under torch.distributed.run the launcher exits 1 when a rank fails and names each rank's code.
"""
from __future__ import annotations

import re
import sys
from typing import NoReturn

# What the config parse and the exit codes need, all of it without torch: the trainer itself (torch,
# diffusers, accelerate: seconds) is imported in main() once the config is good, so `--help` and a
# config error answer at once (tests/test_first_contact.py holds this).
from diffusion_extras.core import commands, stop_flag
from diffusion_extras.data.images import DataError
from diffusion_extras.evaluation.choices import extractors_for, parse_metrics
from diffusion_extras.evaluation.inception_file import check_inception_reachable
from diffusion_extras.hub.secrets import redact_argv
from diffusion_extras.training import disk_space, tracking
from diffusion_extras.training.checkpointing import CheckpointError, refuse_fresh_run_over_checkpoints
from diffusion_extras.training.config import ConfigError, parse_config
from diffusion_extras.training.hooks import Hooks
from diffusion_extras.training.stops import DiskFull, RunStopped

__all__ = ["Hooks", "cli", "finish", "main"]


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> int:
    """Train as `train_ddpm.py argv...` would; `hooks` replaces the extension points (hooks.py).
    Returns the exit code; the calling process is left as it was (commands.leaving_the_process_as_found),
    so a program may call it again."""
    with commands.leaving_the_process_as_found():  # a scheduler's signal during start-up is kept, not fatal
        return train_from_command_line(argv, hooks)


def train_from_command_line(argv: list[str] | None, hooks: Hooks | None) -> int:
    try:
        config = parse_config(argv)
        redact_argv(sys.argv, [config.hub_token])  # trackers (wandb) record the command line
        tracking.check_tracker_available(config.logger)
        if config.find_lr:
            with commands.importing_the_stack():
                from diffusion_extras.training.lr_range import find_lr, setup_lr_range_test
            find_lr(setup_lr_range_test(config, hooks))
            return 0
        check_run_before_the_stack(config)
        with commands.importing_the_stack():
            from diffusion_extras.training.build import setup
            from diffusion_extras.training.loop import train
        run = setup(config, hooks)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finished = False
    try:
        train(run)  # ends the trackers when it finishes
        finished = True
    except DataError as error:  # met in a stream while training (a label outside the declared classes)
        print(f"error: {data_error_line(error)} (met while training). Newest complete checkpoint: "
              f"{disk_space.newest_checkpoint(config.output_dir)}. Fix the data, "
              f"{disk_space.resume_instruction(config.output_dir)}", file=sys.stderr, flush=True)
        return 2
    except RunStopped as stop:  # non-finite steps, preemption, a full disk: the state is saved
        if stop.announce:
            print(f"{stop.prefix}{stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except OSError as error:  # a full disk met by a write no guard covers (the health report, a tracker)
        if not disk_space.is_disk_full(error):
            raise
        print(f"error: {disk_space.full_disk_message(str(error.filename or 'output'), config.output_dir, [])}",
              file=sys.stderr, flush=True)
        return DiskFull.exit_code
    finally:
        if not finished:  # every other way out ends the trackers too (their files closed, wandb's run ended)
            run.accelerator.end_training()
    return 0


def check_run_before_the_stack(config) -> None:
    """What a training run can refuse without torch, before the trainer is imported (seconds): an
    output_dir that holds another run's checkpoints, FID/KID offline without the Inception detector,
    a push without a token, a valid repo name or the network. setup() asks again, after
    --overwrite_output_dir has moved the earlier run aside, as it builds the detector
    (artifacts.prepare_evaluation) and before the Hub repo is created (artifacts.connect_hub), for
    callers of the library."""
    if not config.overwrite_output_dir:
        refuse_fresh_run_over_checkpoints(config.output_dir, config.resume_from_checkpoint)
    if config.eval_steps is not None:  # offline without the detector (prepare_evaluation asks again)
        try:
            check_inception_reachable(extractors_for(parse_metrics(config.eval_metrics), config.feature_extractor),
                                      config.inception_weights)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if config.push_to_hub:
        from diffusion_extras.hub.push import check_push  # huggingface_hub: a fraction of a second
        try:
            check_push(config.hub_token, config.output_dir, config.hub_model_id)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def cli() -> None:
    """The process entry (train_ddpm.py, `ddpm-train`): main(), then exit with its code."""
    stop_flag.record_early_signals()  # as train_ddpm.py does: until the exit, a stop signal is only recorded
    finish(main())


def finish(code: int) -> NoReturn:
    """End the training process with `code` once main() has returned (its state is on disk)."""
    stop_flag.ignore_at_exit()
    commands.exit_with(code)


def data_error_line(error: DataError) -> str:
    """The DataError's own one line, also when a DataLoader worker raised it: torch re-raises it in
    the main process with the worker's whole traceback as its message (ExceptionWrapper.reraise)."""
    found = re.findall(r"DataError: (.+)", str(error))
    return found[-1].strip() if found else str(error)
