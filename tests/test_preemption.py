"""Preemption (training/preemption.py): SIGTERM or SIGUSR1 after step N saves checkpoint-N through
the atomic save, prints one line and exits 4; resuming gives the uninterrupted run's weights, bit
for bit. 1 and 2 ranks, cached and streamed data. A signal at a chosen step is one the run sends
itself (faults.hooks(signal_at_step=N)): deterministic, and for one rank in this process (the trainer's
main() takes the signal and gives the test process its handlers back). Two ranks, and signals from
outside (a scheduler, a process group), are processes."""
import os
import re

import faults
import pytest
import torch
from helpers import assert_same_state, read_history, run_training, write_tiny_recipe
from processes import launch_training, torchrun

from diffusion_extras.training.checkpointing import verify_checkpoint

STEPS, EVERY = 6, 3  # checkpoints at 3 and 6; a stop at 2 is off the checkpoint grid
CPU = {"ACCELERATE_USE_CPU": "1"}
STOP_LINE = re.compile(r"^preempted: (.+?) received; stopped after optimizer step (\d+) with checkpoint (\S+?)"
                       r"(?:, [\d.]+ s after it)?\. "
                       r"Continue with the same command and --resume_from_checkpoint latest$", re.MULTILINE)


def stop_lines(result):
    return STOP_LINE.findall(result.stderr)


def fault_flags(named: dict) -> tuple:
    """faults.hooks' keywords as tests/faults.py's flags: {"signal_at_step": 2} -> ("--signal_at_step", 2)."""
    return tuple(part for name, value in named.items()
                 for part in (f"--{name}", *(value if isinstance(value, (list, tuple)) else [value])))


def train_ranks(recipe, output_dir, *flags, ranks=1, check=True, **named):
    """The trainer with the faults `named` (faults.hooks' keywords): one rank in this process, more as
    that many processes (launch, tests/faults.py). A CompletedProcess; `returncodes`, each rank's."""
    if ranks == 1:
        result = run_training(recipe, output_dir, *flags, hooks=faults.hooks(**named), check=check)
        result.returncodes = [result.returncode]
        return result
    return launch_training(recipe, output_dir, *flags, ranks=ranks, env=CPU, faults=fault_flags(named), check=check)


def assert_preempted_at(result, output_dir, step, signal="SIGTERM", ranks=1):
    assert result.returncodes == [4] * ranks and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert stop_lines(result) == [(signal, str(step), str(output_dir / f"checkpoint-{step}"))]
    assert verify_checkpoint(str(output_dir / f"checkpoint-{step}")) is None
    assert not [name for name in os.listdir(output_dir) if name.endswith(".tmp")]
    assert not os.path.exists(output_dir / f"checkpoint-{step + 1}") and not os.path.exists(output_dir / "unet")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 1-rank cached run every test compares with."""
    folder = tmp_path_factory.mktemp("straight")
    recipe = write_tiny_recipe(folder, max_train_steps=STEPS, checkpointing_steps=EVERY)
    run_training(recipe, folder / "run")
    return recipe, folder / "run"


@pytest.mark.xdist_group("test_preemption.straight")
def test_sigterm_saves_at_the_step_and_resumes_bit_identical(straight, tmp_path):
    recipe, reference = straight
    out = tmp_path / "run"
    result = train_ranks(recipe, out, check=False, signal_at_step=2)
    assert_preempted_at(result, out, 2)
    run_training(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


@pytest.mark.xdist_group("test_preemption.straight")
def test_sigusr1_at_a_checkpoint_step_with_a_second_signal_in_the_save(straight, tmp_path):
    """Stop at a step that checkpoints anyway: one save, not two; a SIGTERM while it is completed
    (files written, marker not yet) is ignored and the checkpoint is whole."""
    recipe, reference = straight
    out = tmp_path / "run"
    result = train_ranks(recipe, out, check=False, signal_at_step=EVERY, signal_name="SIGUSR1",
                         signal_in_save=EVERY)
    assert_preempted_at(result, out, EVERY, signal="SIGUSR1")
    assert result.stdout.count(f"saved {out / f'checkpoint-{EVERY}'}") == 1
    run_training(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


def test_the_stop_agreement_waits_at_its_collective_as_long_as_the_process_group(monkeypatch):
    """The stop agreement's gloo group takes the process group's timeout (build.py's
    COLLECTIVE_TIMEOUT_MINUTES), not torch's default for a new gloo group: a rank held at either
    collective (a network cut) fails after the same wait. A one-process gloo world stands in for the
    ranks; the constant is set to a value torch would not choose by itself."""
    from datetime import timedelta
    from types import SimpleNamespace

    from diffusion_extras.training import build, preemption
    monkeypatch.setattr(build, "COLLECTIVE_TIMEOUT_MINUTES", 7)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        watch = preemption.PreemptionWatch(SimpleNamespace(num_processes=2, process_index=0))
        try:
            assert watch.group._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=7)
            assert not watch.requested()  # the group works: the one-element all-reduce
        finally:
            watch.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("ranks", [1, 2])
def test_streamed_data_preempted_and_resumed_exactly(tiny_recipe, tmp_path, parquet_images, ranks):
    """Each rank's stream position is saved at the stop step; resumed, the run dies right after
    checkpoint-3 (tests/faults.py) and is resumed again: it equals an uninterrupted streamed run with
    the same number of ranks, bit for bit. Of 2 ranks only rank 1 receives the signal: rank 0 learns
    it through the per-step flag all-reduce, both stop after the same step and exit 4, and rank 0
    says why."""
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=EVERY, max_train_samples=None)
    flags = ["--streaming", "--dataset_name", parquet_images, "--shuffle_buffer_size", 0, "--max_train_steps", STEPS]
    reference, out = tmp_path / "straight", tmp_path / "run"
    train_ranks(recipe, reference, *flags, ranks=ranks)
    one_rank_signalled = {"signal_ranks": 1} if ranks == 2 else {}
    result = train_ranks(recipe, out, *flags, ranks=ranks, check=False, signal_at_step=2, **one_rank_signalled)
    assert_preempted_at(result, out, 2, "a stop signal (on another rank)" if ranks == 2 else "SIGTERM", ranks=ranks)
    assert {f"rank_state_{rank}.json" for rank in range(ranks)} <= set(os.listdir(out / "checkpoint-2"))
    resume = (*flags, "--resume_from_checkpoint", "latest")
    if ranks == 1:  # the resumed run dies right after checkpoint-3: in this process, an exception
        with pytest.raises(faults.ProcessDied):
            train_ranks(recipe, out, *resume, stop_after_checkpoint=EVERY)
    else:
        train_ranks(recipe, out, *resume, ranks=ranks, stop_after_checkpoint=EVERY)
    assert os.path.isdir(out / f"checkpoint-{EVERY}") and not os.path.exists(out / f"checkpoint-{STEPS}")
    train_ranks(recipe, out, *resume, ranks=ranks)
    assert_same_state(reference, out, STEPS)


def processes() -> dict[int, tuple[int, list[bytes]]]:
    """{pid: (parent pid, environment)} of this user's processes (from /proc)."""
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/environ", "rb") as fh:
                found[int(name)] = parent, fh.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
    return found


def descendants(pid: int) -> list[int]:
    table, found = processes(), [pid]
    for parent in found:
        found += [child for child, (its_parent, _) in table.items() if its_parent == parent]
    return found[1:]


def wait_while_running(process, done, read_stderr=str, seconds=300) -> None:
    """Poll `done()` every 50 ms until it holds, for at most `seconds`; the command must not end
    meanwhile (if it does, or the time runs out, the failure shows `read_stderr()`)."""
    import time
    deadline = time.monotonic() + seconds
    while not done():
        assert process.poll() is None, read_stderr()[-3000:]
        assert time.monotonic() < deadline, f"not there after {seconds} s:\n{read_stderr()[-3000:]}"
        time.sleep(0.05)


def signal_a_running_command(recipe, out, tmp_path, flags=(), launcher=None, signal_name="SIGTERM", group=False,
                             with_faults=(), ready=None, ranks=1):
    """Start the training command line (train_ddpm.py, or with `with_faults`, flags of tests/faults.py,
    the trainer with those faults and probes; `ranks` > 1: that many ranks
    started as srun starts a job step's tasks, processes.start_command) in a session of its own, wait
    for checkpoint-2 (training is under way), then send `signal_name` to the command (`group=False`:
    as a scheduler that signals the launched process) or to its whole process group (`group=True`:
    the launcher, the ranks and every loader worker, as Slurm and a terminal's Ctrl-C do).
    `ready(process, read_stdout)`, when given, waits for the moment after checkpoint-2 and returns
    the pids to signal (group=False). The output goes to files, so a command that prints while the
    test waits never blocks on a full pipe. Returns (the exit codes, one per rank or the launcher's,
    stdout, stderr, seconds from the signal to the exit)."""
    import signal
    import sys
    import time

    from processes import cli_env, start_command
    env = {**cli_env(), **CPU}  # cli_env: its lines written as they are printed
    script = ["tests/faults.py", *map(str, with_faults), "--"] if with_faults else ["train_ddpm.py"]
    command = [*(launcher or [sys.executable]), *script, "--config", recipe, "--output_dir", str(out),
               *map(str, flags)]
    stdout_path, stderr_path = tmp_path / "command.stdout", tmp_path / "command.stderr"
    read_stdout = stdout_path.read_text
    with start_command(command, env, stdout_path, stderr_path, ranks=ranks) as process:
        try:
            saved = f"saved {out / 'checkpoint-2'}\n"  # training is under way
            wait_while_running(process, lambda: saved in read_stdout(), stderr_path.read_text)
            pids = ready(process, read_stdout) if ready else [process.pid]
            signalled = time.monotonic()
            number = getattr(signal, signal_name)
            if group:
                os.killpg(process.pid, number)
            for pid in [] if group else pids:
                os.kill(pid, number)
            process.wait(timeout=120)
        finally:  # a failed test leaves nothing running (torch.distributed.run gives each rank a session)
            if process.poll() is None:
                for pid in [pid for rank in process.pids for pid in [rank, *descendants(rank)]]:
                    os.kill(pid, signal.SIGKILL)
        return process.returncodes, read_stdout(), stderr_path.read_text(), time.monotonic() - signalled


def assert_stopped_and_resume_equals_straight(recipe, out, tmp_path, result, signal_name, flags=(), launcher=None):
    """One stop line naming the signal, a whole checkpoint at the stop step within a 30-s grace
    period, no traceback; resumed to a later checkpoint step, the run equals a straight run to it
    (constant LR: the length does not shape the schedule), bit for bit."""
    returncodes, _, stderr, seconds = result
    stops = STOP_LINE.findall(stderr)
    assert len(stops) == 1, stderr[-3000:]
    [(name, step, path)] = stops
    assert name == signal_name and int(step) >= 2 and path == str(out / f"checkpoint-{step}"), stderr[-2000:]
    assert (returncodes == [4]) if launcher is None else (returncodes[0] != 0), stderr[-2000:]
    if launcher is None:  # torch.distributed.run reports its ranks' exit codes with a traceback of its own
        assert "Traceback" not in stderr and "killed by signal" not in stderr, stderr[-3000:]
    assert verify_checkpoint(path) is None and seconds < 30  # well inside a 30-second grace period
    end = (int(step) // 2 + 2) * 2  # a later checkpoint step (every 2): both runs save their state there
    ranks = 1 if launcher is None else 2  # what is compared is the ranks' training: no launcher needed
    train_ranks(recipe, out, *flags, "--resume_from_checkpoint", "latest", "--max_train_steps", end,
                ranks=ranks)
    train_ranks(recipe, tmp_path / "straight", *flags, "--max_train_steps", end, ranks=ranks)
    assert_same_state(tmp_path / "straight", out, end)


def endless_recipe(tiny_recipe, **overrides):
    return tiny_recipe(train_batch_size=4, max_train_steps=100_000, checkpointing_steps=2,
                       lr_scheduler="constant_with_warmup", lr_warmup_steps=2, **overrides)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_scheduler_sigterm_to_the_launched_command_saves_and_resumes_bit_identical(tiny_recipe, tmp_path, ranks):
    """The signal from outside, as a job scheduler sends it: to `python train_ddpm.py`, or to the
    torch.distributed.run launcher, which forwards it to every rank. The run is signalled once
    checkpoint-2 is saved and stops at whatever step it has reached with a checkpoint there."""
    recipe, out, launcher = endless_recipe(tiny_recipe), tmp_path / "run", torchrun() if ranks == 2 else None
    result = signal_a_running_command(recipe, out, tmp_path, launcher=launcher)
    assert_stopped_and_resume_equals_straight(recipe, out, tmp_path, result, "SIGTERM",
                                              launcher=launcher)


# 1 to 3 loader workers, each signal once, cached and streamed: a run per pair, not per product
@pytest.mark.parametrize("workers, signal_name", [(1, "SIGTERM"), (2, "SIGUSR1"), (3, "SIGINT")])
def test_a_signal_to_the_process_group_with_loader_workers(tiny_recipe, tmp_path, workers, signal_name):
    """Slurm and Ctrl-C signal every process, the DataLoader workers included: the
    workers ignore it (data/workers.py), the trainer saves at the step, exits 4 with one line and no
    traceback, and the resume equals the straight run."""
    recipe, out = endless_recipe(tiny_recipe, dataloader_num_workers=workers), tmp_path / "run"
    result = signal_a_running_command(recipe, out, tmp_path, signal_name=signal_name, group=True)
    assert_stopped_and_resume_equals_straight(recipe, out, tmp_path, result, signal_name)


@pytest.mark.parametrize("workers, signal_name", [(1, "SIGUSR1"), (2, "SIGTERM"), (3, "SIGUSR1")])
def test_a_process_group_signal_to_a_streamed_run_with_loader_workers(tiny_recipe, tmp_path,
                                                                      parquet_images, workers, signal_name):
    """As above with streamed data: 4 parquet shards over 1, 2 or 3 workers (3: two workers read one
    shard each, one reads two), every worker's place in the stream saved at the stop."""
    recipe, out = endless_recipe(tiny_recipe, max_train_samples=None), tmp_path / "run"
    flags = ["--streaming", "--dataset_name", parquet_images, "--shuffle_buffer_size", 0,
             "--dataloader_num_workers", workers]
    result = signal_a_running_command(recipe, out, tmp_path, flags, signal_name=signal_name, group=True)
    assert_stopped_and_resume_equals_straight(recipe, out, tmp_path, result, signal_name, flags)


# Each denoising step of a signalled run that samples sleeps DENOISE_SECONDS (tests/faults.py
# --denoise_seconds): a batch of 100 DDIM steps then takes SLOW_BATCH_SECONDS however loaded the
# machine, at little CPU. A stop that comes sooner than that gave up between denoising steps.
DENOISE_SECONDS = 0.25
SLOW_DENOISING = ("--denoise_seconds", DENOISE_SECONDS)
SLOW_BATCH_SECONDS = 100 * DENOISE_SECONDS
QUICK_SAMPLING = ("--ddpm_num_inference_steps", 2)


def test_a_signal_during_the_final_grid_stops_between_denoising_steps_and_the_resume_does_the_end_work(
        tiny_recipe, tmp_path):
    """The signal lands in the end-of-run sample grid (100 slowed DDIM steps): the grid gives up
    between denoising steps (core/stop_flag.py), checkpoint-3 is written before the grid could have
    finished, nothing of the grid or the export is left; the resume at the last step does the
    end-of-run work (grid, export), and the exported weights and losses equal those of an
    uninterrupted run."""
    from helpers import load_unet_weights
    recipe = tiny_recipe(max_train_steps=3, checkpointing_steps=2, save_images_steps=1000,
                         ddpm_num_inference_steps=100)
    out = tmp_path / "run"

    def in_the_final_grid(process, read_stdout):
        wait_while_running(process, lambda: re.search(r"^final sample grid", read_stdout(), re.MULTILINE))
    returncodes, _, stderr, seconds = signal_a_running_command(recipe, out, tmp_path, signal_name="SIGUSR1",
                                                               group=True, ready=in_the_final_grid,
                                                               with_faults=SLOW_DENOISING)
    assert returncodes == [4] and "Traceback" not in stderr, stderr[-3000:]
    assert STOP_LINE.findall(stderr) == [("SIGUSR1", "3", str(out / "checkpoint-3"))]
    assert seconds < SLOW_BATCH_SECONDS, f"{seconds:.1f} s from the signal to the exit: the grid ran on"
    assert verify_checkpoint(str(out / "checkpoint-3")) is None
    assert not os.path.exists(out / "samples") and not os.path.exists(out / "unet")  # nothing half-written
    # The end-of-run grid's length shapes no weight: the resume and the reference draw theirs in 2
    # steps, unslowed.
    resumed = run_training(recipe, out, "--resume_from_checkpoint", "latest", *QUICK_SAMPLING)
    assert "resumed at the last step (3)" in resumed.stdout
    assert os.path.exists(out / "samples" / "step_000003.png") and os.path.exists(out / "unet")
    run_training(recipe, tmp_path / "straight", *QUICK_SAMPLING)
    assert [h["loss"] for h in read_history(out)] == [h["loss"] for h in read_history(tmp_path / "straight")]
    exported, straight = load_unet_weights(out), load_unet_weights(tmp_path / "straight")
    assert all(torch.equal(exported[k], straight[k]) for k in straight)


# Two ranks (one loader worker each), the signal during the work between steps (core/stop_flag.py),
# all at step 2: FID/KID of 12 images in batches of 4 (batch k to rank k mod 2: rank 0 samples 8,
# rank 1 4), a 4-image grid of rows (one row of 2 a rank), then the held-out loss and gradient
# monitor on rank 0 alone. The signalled run's denoising is slowed (SLOW_DENOISING): the work at
# step 2 would take three slowed batches (two with the grid test's own FID), and the stop must
# come before one could finish, at step 2 on both ranks. The resume, and the uninterrupted run it
# is compared with, sample with 2 DDIM steps unslowed (sampling never touches the training state).
IN_WORK = dict(train_batch_size=4, dataloader_num_workers=1, max_train_steps=4, checkpointing_steps=2,
               save_images_steps=2, eval_steps=2, eval_num_samples=12, eval_batch_size=4, feature_extractor="tiny",
               ddpm_num_inference_steps=100, validation_split=0.1, validation_steps=2, grad_diagnostics_steps=2)


@pytest.fixture(scope="module")
def straight_two_ranks_with_work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight_with_work")
    launch_training(write_tiny_recipe(folder, **IN_WORK), folder / "run", *QUICK_SAMPLING, ranks=2, env=CPU)
    return folder / "run"


def assert_stopped_in_work_and_resume_equals_straight(recipe, out, straight, result, signal_name):
    """Stopped at step 2 before a slowed batch could finish (uninterrupted, the work at step 2 takes
    two batches or more), one stop line, exit code 4 on both ranks, no traceback, checkpoint-2 whole
    and nothing of the step-2 grid or export written; the resumed run's losses, weights and
    checkpoint-4 equal the uninterrupted run's, bit for bit."""
    returncodes, _, stderr, seconds = result
    assert returncodes == [4, 4] and "Traceback" not in stderr, stderr[-3000:]
    assert STOP_LINE.findall(stderr) == [(signal_name, "2", str(out / "checkpoint-2"))], stderr[-3000:]
    assert seconds < SLOW_BATCH_SECONDS, f"{seconds:.1f} s from the signal to the exit: a batch ran on"
    assert verify_checkpoint(str(out / "checkpoint-2")) is None
    assert not os.path.exists(out / "samples") and not os.path.exists(out / "unet")
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    launch_training(recipe, out, *QUICK_SAMPLING, "--resume_from_checkpoint", "latest", ranks=2, env=CPU)
    assert_same_state(straight, out, IN_WORK["max_train_steps"])


@pytest.mark.xdist_group("test_preemption.straight_two_ranks_with_work")
def test_two_ranks_sigterm_to_every_rank_and_worker_during_the_sample_grid_stops_both_within_seconds(
        straight_two_ranks_with_work, tmp_path):
    """SIGTERM to both ranks and their loader workers at once, as srun delivers it to the tasks of
    examples/slurm/train_multi_node.sbatch, once the FID at step 2 is scored, while the grid's rows
    are sampled on both ranks: each gives up between denoising steps and they agree before the
    gather. (The ranks are started as srun starts them, without a launcher between: a signalled
    torch.distributed.run is test_a_scheduler_sigterm_to_the_launched_command's.) This run's FID
    has 8 images, a batch on each rank, sampled at once (25 s); the grid's rows would take 25 s more."""
    recipe, out = write_tiny_recipe(tmp_path, **{**IN_WORK, "eval_num_samples": 8}), tmp_path / "run"

    def after_the_fid(process, read_stdout):
        wait_while_running(process, lambda: "step 2: fid" in read_stdout())
        return [pid for rank in process.pids for pid in [rank, *descendants(rank)]]  # its loader worker too
    result = signal_a_running_command(recipe, out, tmp_path, ranks=2, ready=after_the_fid, with_faults=SLOW_DENOISING)
    assert_stopped_in_work_and_resume_equals_straight(recipe, out, straight_two_ranks_with_work, result,
                                                      "SIGTERM")


@pytest.mark.xdist_group("test_preemption.straight_two_ranks_with_work")
def test_two_ranks_a_sigusr1_to_rank_1_alone_waiting_for_rank_0s_fid_share_stops_both(
        straight_two_ranks_with_work, tmp_path):
    """SIGUSR1 to rank 1 alone once it has sampled its batch of FID images (25 s) and waits for rank
    0's two (50 s): rank 1 publishes the stop while it waits, rank 0 gives its share up, and rank 0's
    share is never done."""
    recipe, out, shares = write_tiny_recipe(tmp_path, **IN_WORK), tmp_path / "run", tmp_path / "shares"

    def when_rank_1_waits(process, read_stdout):
        wait_while_running(process, lambda: os.path.exists(shares / "rank1.jsonl"))
        assert not os.path.exists(shares / "rank0.jsonl")  # rank 0 is still sampling
        return process.pids[1:]
    result = signal_a_running_command(recipe, out, tmp_path, ranks=2, signal_name="SIGUSR1",
                                      with_faults=("--record_shares", shares, *SLOW_DENOISING), ready=when_rank_1_waits)
    assert not os.path.exists(shares / "rank0.jsonl")  # gave up, not finished
    assert not [h for h in read_history(out) if any(key.startswith("eval/") for key in h)]  # no FID logged
    assert_stopped_in_work_and_resume_equals_straight(recipe, out, straight_two_ranks_with_work, result,
                                                      "a stop signal (on another rank)")
