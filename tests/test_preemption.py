"""Preemption (training/preemption.py): SIGTERM or SIGUSR1 after step N saves checkpoint-N through
the atomic save, prints one line and exits 4; resuming gives the uninterrupted run's weights, bit
for bit. 1 and 2 ranks, cached and streamed data. The signal is sent in-process by
tests/hooked_train.py (DDPM_TEST_SIGNAL_AT_STEP) after a chosen step: deterministic."""
import os
import re

import pytest
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
    hooked_train(recipe, reference, launcher=torchrun(), env=CPU)
    result = hooked_train(recipe, out, launcher=torchrun(), env={**CPU, "DDPM_TEST_SIGNAL_AT_STEP": "2:SIGTERM:1"},
                          check=False)
    assert re.search(r"exitcode\s*:\s*4", result.stderr), result.stderr[-3000:]
    assert stop_lines(result) == [("a stop signal (on another rank)", "2", str(out / "checkpoint-2"))]  # rank 0 speaks
    assert verify_checkpoint(str(out / "checkpoint-2")) is None and not os.path.exists(out / ".checkpoint-2.tmp")
    hooked_train(recipe, out, "--resume_from_checkpoint", "latest", launcher=torchrun(), env=CPU)
    assert_same_state(reference, out, STEPS)


@pytest.mark.parametrize("ranks", [1, 2])
def test_streamed_data_preempted_and_resumed_exactly(hooked_train, tiny_recipe, tmp_path, parquet_images, ranks):
    """Each rank's stream position is saved at the stop step; the resumed run equals an
    uninterrupted streamed run with the same number of ranks, bit for bit."""
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=EVERY, max_train_samples=None)
    flags = ["--streaming", "--dataset_name", parquet_images, "--shuffle_buffer_size", 0, "--max_train_steps", STEPS]
    launcher = torchrun() if ranks == 2 else None
    reference, out = tmp_path / "straight", tmp_path / "run"
    hooked_train(recipe, reference, *flags, launcher=launcher, env=CPU)
    result = hooked_train(recipe, out, *flags, launcher=launcher, env={**CPU, "DDPM_TEST_SIGNAL_AT_STEP": "2"},
                          check=False)
    assert_preempted_at(result, out, 2, ranks=ranks)
    assert {f"rank_state_{rank}.json" for rank in range(ranks)} <= set(os.listdir(out / "checkpoint-2"))
    hooked_train(recipe, out, *flags, "--resume_from_checkpoint", "latest", launcher=launcher, env=CPU)
    assert_same_state(reference, out, STEPS)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_scheduler_sigterm_to_the_launched_command_saves_and_resumes_bit_identical(train, tiny_recipe, tmp_path,
                                                                                       ranks):
    """The signal from outside, as a job scheduler sends it: to `python train_ddpm.py`, or to the
    torch.distributed.run launcher, which forwards it to every rank. The run is signalled once
    checkpoint-2 is saved, stops at whatever step it has reached with a checkpoint there, and its
    resume to a later checkpoint step equals a straight run to that step (constant LR: the length does
    not shape the schedule)."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, cli_env
    recipe = tiny_recipe(train_batch_size=4, max_train_steps=100_000, checkpointing_steps=2,
                         lr_scheduler="constant_with_warmup", lr_warmup_steps=2)
    out = tmp_path / "run"
    launcher = torchrun() if ranks == 2 else [sys.executable]
    env = {**cli_env(tmp_path), **CPU, "PYTHONUNBUFFERED": "1"}  # its lines as they are printed
    with subprocess.Popen([*launcher, "train_ddpm.py", "--config", recipe, "--output_dir", str(out)], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        for line in process.stdout:  # checkpoint-2 saved: training is under way
            if "saved" in line and line.rstrip().endswith("checkpoint-2"):
                break
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
        seconds = time.monotonic() - signalled
    stops = STOP_LINE.findall(stderr)
    assert len(stops) == 1, stderr[-3000:]
    [(name, step, path)] = stops
    assert name == "SIGTERM" and int(step) >= 2 and path == str(out / f"checkpoint-{step}"), stderr[-2000:]
    assert (process.returncode == 4) if ranks == 1 else (process.returncode != 0), stderr[-2000:]
    assert verify_checkpoint(path) is None and seconds < 30  # well inside a 30-second grace period
    end = (int(step) // 2 + 2) * 2  # a later checkpoint step (every 2): both runs save their state there
    launch = torchrun() if ranks == 2 else None
    train(recipe, out, "--resume_from_checkpoint", "latest", "--max_train_steps", end, launcher=launch, env=CPU)
    train(recipe, tmp_path / "straight", "--max_train_steps", end, launcher=launch, env=CPU)
    assert_same_state(tmp_path / "straight", out, end)
