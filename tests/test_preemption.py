"""Preemption (training/preemption.py): SIGTERM or SIGUSR1 after step N saves checkpoint-N through
the atomic save, prints one line and exits 4; resuming gives the uninterrupted run's weights, bit
for bit. 1 and 2 ranks, cached and streamed data. The signal is sent in-process by
tests/hooked_train.py (DDPM_TEST_SIGNAL_AT_STEP) after a chosen step: deterministic."""
import os
import re

import pytest
import torch
from conftest import HOOKED_TRAIN, run_training, write_tiny_recipe
from test_resume import assert_same_state, torchrun

from diffusion_extras.training.checkpointing import verify_checkpoint

STEPS, EVERY = 6, 3  # checkpoints at 3 and 6; a stop at 2 is off the checkpoint grid
CPU = {"ACCELERATE_USE_CPU": "1"}
STOP_LINE = re.compile(r"^preempted: (.+?) received; stopped after optimizer step (\d+) with checkpoint (\S+?)"
                       r"(?:, [\d.]+ s after it)?\. "
                       r"Continue with the same command and --resume_from_checkpoint latest$", re.MULTILINE)


def stop_lines(result):
    return STOP_LINE.findall(result.stderr)


def assert_preempted_at(result, output_dir, step, signal="SIGTERM", ranks=1):
    if ranks == 1:
        assert result.returncode == 4, result.stderr[-3000:]
    else:  # the launcher exits 1 and names each rank's exit code
        assert result.returncode != 0 and re.search(r"exitcode\s*:\s*4", result.stderr), result.stderr[-3000:]
    assert stop_lines(result) == [(signal, str(step), str(output_dir / f"checkpoint-{step}"))]
    assert verify_checkpoint(str(output_dir / f"checkpoint-{step}")) is None
    assert not [name for name in os.listdir(output_dir) if name.endswith(".tmp")]
    assert not os.path.exists(output_dir / f"checkpoint-{step + 1}") and not os.path.exists(output_dir / "unet")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 1-rank cached run every test compares with."""
    folder = tmp_path_factory.mktemp("straight")
    recipe = write_tiny_recipe(folder, max_train_steps=STEPS, checkpointing_steps=EVERY)
    run_training(folder, recipe, folder / "run", script=HOOKED_TRAIN)
    return recipe, folder / "run"


def test_sigterm_saves_at_the_step_and_resumes_bit_identical(straight, hooked_train, tmp_path):
    recipe, reference = straight
    out = tmp_path / "run"
    result = hooked_train(recipe, out, env={"DDPM_TEST_SIGNAL_AT_STEP": "2"}, check=False)
    assert_preempted_at(result, out, 2)
    hooked_train(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


def test_sigusr1_at_a_checkpoint_step_with_a_second_signal_in_the_save(straight, hooked_train, tmp_path):
    """Stop at a step that checkpoints anyway: one save, not two; a SIGTERM while it is completed
    (files written, marker not yet) is ignored and the checkpoint is whole."""
    recipe, reference = straight
    out = tmp_path / "run"
    result = hooked_train(recipe, out, env={"DDPM_TEST_SIGNAL_AT_STEP": f"{EVERY}:SIGUSR1",
                                            "DDPM_TEST_SIGNAL_IN_SAVE": str(EVERY)}, check=False)
    assert_preempted_at(result, out, EVERY, signal="SIGUSR1")
    assert result.stdout.count(f"saved {out / f'checkpoint-{EVERY}'}") == 1
    hooked_train(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


def test_two_ranks_agree_on_the_stop_step_when_one_rank_is_signalled(hooked_train, tiny_recipe, tmp_path):
    """Only rank 1 receives the signal: rank 0 learns it through the per-step flag all-reduce and
    both stop after the same step; the resumed run equals an uninterrupted 2-rank run."""
    recipe = tiny_recipe(train_batch_size=4, max_train_steps=STEPS, checkpointing_steps=EVERY)
    reference, out = tmp_path / "straight", tmp_path / "run"
    hooked_train(recipe, reference, ranks=2, env=CPU)
    result = hooked_train(recipe, out, launcher=torchrun(), env={**CPU, "DDPM_TEST_SIGNAL_AT_STEP": "2:SIGTERM:1"},
                          check=False)
    assert re.search(r"exitcode\s*:\s*4", result.stderr), result.stderr[-3000:]
    assert stop_lines(result) == [("a stop signal (on another rank)", "2", str(out / "checkpoint-2"))]  # rank 0 speaks
    assert verify_checkpoint(str(out / "checkpoint-2")) is None and not os.path.exists(out / ".checkpoint-2.tmp")
    hooked_train(recipe, out, "--resume_from_checkpoint", "latest", ranks=2, env=CPU)
    assert_same_state(reference, out, STEPS)


@pytest.mark.parametrize("ranks", [1, 2])
def test_streamed_data_preempted_and_resumed_exactly(hooked_train, tiny_recipe, tmp_path, parquet_images, ranks):
    """Each rank's stream position is saved at the stop step; the resumed run equals an
    uninterrupted streamed run with the same number of ranks, bit for bit."""
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=EVERY, max_train_samples=None)
    flags = ["--streaming", "--dataset_name", parquet_images, "--shuffle_buffer_size", 0, "--max_train_steps", STEPS]
    launcher = torchrun() if ranks == 2 else None
    reference, out = tmp_path / "straight", tmp_path / "run"
    hooked_train(recipe, reference, *flags, ranks=ranks, env=CPU)
    result = hooked_train(recipe, out, *flags, launcher=launcher, env={**CPU, "DDPM_TEST_SIGNAL_AT_STEP": "2"},
                          check=False)
    assert_preempted_at(result, out, 2, ranks=ranks)
    assert {f"rank_state_{rank}.json" for rank in range(ranks)} <= set(os.listdir(out / "checkpoint-2"))
    hooked_train(recipe, out, *flags, "--resume_from_checkpoint", "latest", ranks=ranks, env=CPU)
    assert_same_state(reference, out, STEPS)


def signal_a_running_command(recipe, out, tmp_path, flags=(), launcher=None, signal_name="SIGTERM", group=False):
    """Start the training command line in a session of its own, wait for checkpoint-2 (training is
    under way), then send `signal_name` to the command (`group=False`: as a scheduler that signals
    the launched process) or to its whole process group (`group=True`: the launcher, the ranks and
    every loader worker, as Slurm and a terminal's Ctrl-C do). Returns (returncode, stdout, stderr,
    seconds from the signal to the exit)."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, cli_env
    env = {**cli_env(), **CPU, "PYTHONUNBUFFERED": "1"}  # its lines as they are printed
    command = [*(launcher or [sys.executable]), "train_ddpm.py", "--config", recipe, "--output_dir", str(out),
               *map(str, flags)]
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        for line in process.stdout:  # checkpoint-2 saved: training is under way
            if "saved" in line and line.rstrip().endswith("checkpoint-2"):
                break
        signalled = time.monotonic()
        number = getattr(signal, signal_name)
        if group:
            os.killpg(process.pid, number)
        else:
            process.send_signal(number)
        stdout, stderr = process.communicate(timeout=120)
        return process.returncode, stdout, stderr, time.monotonic() - signalled


def assert_stopped_and_resume_equals_straight(train, recipe, out, tmp_path, result, signal_name, flags=(),
                                              launcher=None):
    """One stop line naming the signal, a whole checkpoint at the stop step within a 30-s grace
    period, no traceback; resumed to a later checkpoint step, the run equals a straight run to it
    (constant LR: the length does not shape the schedule), bit for bit."""
    returncode, _, stderr, seconds = result
    stops = STOP_LINE.findall(stderr)
    assert len(stops) == 1, stderr[-3000:]
    [(name, step, path)] = stops
    assert name == signal_name and int(step) >= 2 and path == str(out / f"checkpoint-{step}"), stderr[-2000:]
    assert (returncode == 4) if launcher is None else (returncode != 0), stderr[-2000:]
    if launcher is None:  # torch.distributed.run reports its ranks' exit codes with a traceback of its own
        assert "Traceback" not in stderr and "killed by signal" not in stderr, stderr[-3000:]
    assert verify_checkpoint(path) is None and seconds < 30  # well inside a 30-second grace period
    end = (int(step) // 2 + 2) * 2  # a later checkpoint step (every 2): both runs save their state there
    ranks = 1 if launcher is None else 2  # what is compared is the ranks' training: no launcher needed
    train(recipe, out, *flags, "--resume_from_checkpoint", "latest", "--max_train_steps", end, ranks=ranks, env=CPU)
    train(recipe, tmp_path / "straight", *flags, "--max_train_steps", end, ranks=ranks, env=CPU)
    assert_same_state(tmp_path / "straight", out, end)


def endless_recipe(tiny_recipe, **overrides):
    return tiny_recipe(train_batch_size=4, max_train_steps=100_000, checkpointing_steps=2,
                       lr_scheduler="constant_with_warmup", lr_warmup_steps=2, **overrides)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_scheduler_sigterm_to_the_launched_command_saves_and_resumes_bit_identical(train, tiny_recipe, tmp_path,
                                                                                       ranks):
    """The signal from outside, as a job scheduler sends it: to `python train_ddpm.py`, or to the
    torch.distributed.run launcher, which forwards it to every rank. The run is signalled once
    checkpoint-2 is saved and stops at whatever step it has reached with a checkpoint there."""
    recipe, out, launcher = endless_recipe(tiny_recipe), tmp_path / "run", torchrun() if ranks == 2 else None
    result = signal_a_running_command(recipe, out, tmp_path, launcher=launcher)
    assert_stopped_and_resume_equals_straight(train, recipe, out, tmp_path, result, "SIGTERM", launcher=launcher)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_signal_to_the_process_group_with_two_loader_workers(train, tiny_recipe, tmp_path, signal_name):
    """Slurm and Ctrl-C signal every process, the DataLoader workers included (issue 33): the
    workers ignore it (data/workers.py), the trainer saves at the step, exits 4 with one line and no
    traceback, and the resume equals the straight run."""
    recipe, out = endless_recipe(tiny_recipe, dataloader_num_workers=2), tmp_path / "run"
    result = signal_a_running_command(recipe, out, tmp_path, signal_name=signal_name, group=True)
    assert_stopped_and_resume_equals_straight(train, recipe, out, tmp_path, result, signal_name)


def test_a_process_group_signal_to_a_streamed_run_with_two_loader_workers(train, tiny_recipe, tmp_path,
                                                                          parquet_images):
    recipe, out = endless_recipe(tiny_recipe, max_train_samples=None), tmp_path / "run"
    flags = ["--streaming", "--dataset_name", parquet_images, "--shuffle_buffer_size", 0,
             "--dataloader_num_workers", 2]
    result = signal_a_running_command(recipe, out, tmp_path, flags, signal_name="SIGUSR1", group=True)
    assert_stopped_and_resume_equals_straight(train, recipe, out, tmp_path, result, "SIGUSR1", flags)


def test_a_signal_during_a_1000_step_final_grid_saves_within_seconds_and_the_resume_does_the_end_work(
        train, tiny_recipe, tmp_path):
    """The signal lands in the end-of-run sample grid (1000 DDIM steps): the grid gives up between
    denoising steps (core/stop_flag.py), checkpoint-3 is written within 10 s, nothing of the grid
    or the export is left; the resume at the last step does the end-of-run work (grid, export),
    and the exported weights and losses equal those of an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, cli_env, load_unet_weights, read_history
    recipe = tiny_recipe(max_train_steps=3, checkpointing_steps=2, ddpm_num_inference_steps=1000)
    out = tmp_path / "run"
    env = {**cli_env(), **CPU, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen([sys.executable, "train_ddpm.py", "--config", recipe, "--output_dir", str(out)], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        for line in process.stdout:
            if line.startswith("final sample grid"):
                break
        signalled = time.monotonic()
        os.killpg(process.pid, signal.SIGUSR1)
        stdout, stderr = process.communicate(timeout=120)
        seconds = time.monotonic() - signalled
    assert process.returncode == 4 and "Traceback" not in stderr, stderr[-3000:]
    assert STOP_LINE.findall(stderr) == [("SIGUSR1", "3", str(out / "checkpoint-3"))]
    assert seconds < 10, f"{seconds:.1f} s from the signal to the exit"
    assert verify_checkpoint(str(out / "checkpoint-3")) is None
    assert not os.path.exists(out / "samples") and not os.path.exists(out / "unet")  # nothing half-written
    # The end-of-run grid's length shapes no weight: the resume and the reference draw theirs in 2
    # steps (1000 CPU steps each would add a minute to the test and test nothing more).
    short_grid = ("--ddpm_num_inference_steps", 2)
    resumed = train(recipe, out, "--resume_from_checkpoint", "latest", *short_grid, env=CPU)
    assert "resumed at the last step (3)" in resumed.stdout
    assert os.path.exists(out / "samples" / "step_000003.png") and os.path.exists(out / "unet")
    train(recipe, tmp_path / "straight", *short_grid, env=CPU)
    assert [h["loss"] for h in read_history(out)] == [h["loss"] for h in read_history(tmp_path / "straight")]
    exported, straight = load_unet_weights(out), load_unet_weights(tmp_path / "straight")
    assert all(torch.equal(exported[k], straight[k]) for k in straight)
