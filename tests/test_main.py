"""training/main.py's main(argv, hooks) in a program's own process: every way out leaves the process
as it was (signal handlers, the early-signal record, the stop flag, accelerate's state, torch's
switches, the log handler), ends the run's trackers, and a second run in the same process trains
as the first would have alone."""
import logging
import signal
import threading

import faults
import pytest
from helpers import read_history, run_training

from diffusion_extras.core import stop_flag

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def process_state() -> dict:
    """What a run must leave as it found it."""
    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState
    return {"handlers": [signal.getsignal(number) for number in STOP_SIGNALS],
            "early signal": stop_flag.early_signal(), "stop requested": stop_flag._requested.is_set(),
            "shared stop": stop_flag._shared, "accelerate": (dict(PartialState._shared_state),
                                                              dict(AcceleratorState._shared_state),
                                                              dict(GradientState._shared_state)),
            "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
            "log handlers": list(logging.root.handlers), "log level": logging.root.level}


def threads_started_since(before) -> list:
    """Threads running now that were not before, but for tqdm's monitor (tqdm starts it once per process)."""
    from tqdm._monitor import TMonitor
    return [thread for thread in threading.enumerate() if thread not in before and not isinstance(thread, TMonitor)]


def logged_steps(output_dir) -> list:
    """The steps of the loss scalars in the run's tensorboard event files (flushed when the tracker ends)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    folders = sorted((output_dir / "logs").glob("**/events.out.tfevents.*"))
    steps = set()
    for path in folders:
        events = EventAccumulator(str(path.parent))
        events.Reload()
        if "loss" in events.Tags()["scalars"]:
            steps.update(event.step for event in events.Scalars("loss"))
    return sorted(steps)


# Each way out of a run that had started its trackers: (exit code, hooks, flags, the last step logged)
WAYS_OUT = {
    "done": (0, {}, (), 4),
    "non-finite steps": (3, {"nan_at_steps": (2, 3, 4)}, ("--max_nonfinite_steps", 2), 3),
    "preempted": (4, {"signal_at_step": 2}, (), 2),
    "disk full": (5, {"enospc_at": ("checkpoint", 2)}, (), 2),
}


@pytest.mark.parametrize("way_out", WAYS_OUT)
def test_every_way_out_leaves_the_process_as_found_and_ends_the_trackers(tiny_recipe, tmp_path, way_out):
    code, fault, flags, last_logged = WAYS_OUT[way_out]
    recipe = tiny_recipe(checkpointing_steps=2, logger="tensorboard")
    hooks, kept = faults.hooks(**fault), []
    hooks.after_step = faults.chain(hooks.after_step, kept.append)  # the caller keeps the run: nothing frees it
    before, threads = process_state(), threading.enumerate()
    result = run_training(recipe, tmp_path / "run", "--max_train_steps", 4, *flags, hooks=hooks, check=False)
    assert result.returncode == code, result.stderr[-3000:]
    assert process_state() == before
    # the tracker was ended: its writer's thread has ended, every step it logged in its event file
    assert kept and threads_started_since(threads) == []
    assert logged_steps(tmp_path / "run")[-1] == last_logged


def test_a_refused_run_leaves_the_process_as_found(tiny_recipe, tmp_path):
    before = process_state()
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 0, check=False)
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert process_state() == before


def test_two_trainings_in_one_process_each_as_alone(tiny_recipe, tmp_path, tiny_reference_run):
    """A run stopped by a signal that came while it was set up (kept as an early signal, then taken
    over by the loop), then two runs in the same process: neither is stopped by that signal (its
    record was cleared), each trains every step with the losses of the same run made before them
    (tiny_reference_run: the same recipe, seed and steps)."""
    stopped = run_training(tiny_recipe(checkpointing_steps=2), tmp_path / "stopped", "--max_train_steps", 4,
                           hooks=faults.hooks(signal_in_setup=True), check=False)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    assert "preempted: SIGTERM received; stopped after optimizer step 1" in stopped.stderr
    reference = [entry["loss"] for entry in read_history(tiny_reference_run)]
    for name in ("first", "second"):
        result = run_training(tiny_recipe(), tmp_path / name, "--max_train_steps", 3)
        assert "preempted" not in result.stderr
        history = read_history(tmp_path / name)
        assert [entry["step"] for entry in history] == [1, 2, 3]
        assert [entry["loss"] for entry in history] == reference


def test_ctrl_c_reaches_the_caller_after_a_run(tiny_recipe, tmp_path):
    """After main() returns, SIGINT is the caller's again: Python's KeyboardInterrupt here."""
    run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 1)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
