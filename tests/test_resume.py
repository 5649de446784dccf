"""Checkpoints and exact resume of the trainer: runs in this process (main() with faults as hooks),
and in processes of their own where a process is the subject (a SIGKILL inside a save, 2 ranks)."""
import functools
import os
import shutil

import faults
import pytest
import torch
from helpers import (
    assert_same_state,
    assert_same_tree,
    load_unet_weights,
    read_history,
    run_training,
    write_tiny_recipe,
)
from processes import launch_training

from diffusion_extras.training import checkpointing


def test_assert_same_tree_sees_an_optimizer_moment_and_a_missing_item():
    """The comparison assert_same_state makes: one moment element off, or one EMA tensor fewer, fails."""
    import copy
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.0, 2.0])}},
                 "param_groups": [{"lr": 1e-3, "params": [0]}]}
    assert_same_tree(optimizer, copy.deepcopy(optimizer), "optimizer")
    moved = copy.deepcopy(optimizer)
    moved["state"][0]["exp_avg"][1] = 2.5
    with pytest.raises(AssertionError, match=r"optimizer\['state'\]\[0\]\['exp_avg'\]"):
        assert_same_tree(optimizer, moved, "optimizer")
    with pytest.raises(AssertionError, match="2 vs 1 items"):
        assert_same_tree({"shadow_params": [torch.zeros(1), torch.ones(1)]}, {"shadow_params": [torch.zeros(1)]}, "ema")
    # bitwise: a bin never visited (NaN) in both is the same state; NaN against a number, or -0.0
    # against 0.0, is not
    bins = torch.tensor([float("nan"), 1.5, 0.0], dtype=torch.float64)
    assert_same_tree({"running_bin_loss": bins}, {"running_bin_loss": bins.clone()}, "diagnostics")
    for other in (torch.tensor([1.0, 1.5, 0.0], dtype=torch.float64), torch.tensor([float("nan"), 1.5, -0.0],
                                                                                     dtype=torch.float64)):
        with pytest.raises(AssertionError, match="tensors differ"):
            assert_same_tree({"running_bin_loss": bins}, {"running_bin_loss": other}, "diagnostics")


# 64 images, 8 per micro-batch: 8 micro-batches an epoch, so step 5 (accumulation 1) and step 3
# (accumulation 2: micro-step 6) stop mid-epoch, and the run to 2N crosses an epoch boundary.
@pytest.mark.parametrize("accumulation,half,extras", [
    (1, 5, {}), (2, 3, {}),
    # loss-aware timesteps, min-SNR, v-prediction and post-hoc EMA: all their state must round-trip
    (1, 4, {"timestep_sampling": "loss_aware", "snr_gamma": 5.0, "prediction_type": "v_prediction",
            "posthoc_ema": True}),
])
def test_resume_is_bitwise_identical_to_straight_run(tiny_recipe, tmp_path, accumulation, half, extras):
    recipe = tiny_recipe(checkpointing_steps=half, lr_scheduler="cosine", gradient_accumulation_steps=accumulation,
                         **extras)
    full = 2 * half
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_training(recipe, straight, "--max_train_steps", full, "--checkpointing_steps", half)
    # the first half is a run that dies at step `half`: the LR schedule still spans `full` steps
    with pytest.raises(faults.ProcessDied):
        run_training(recipe, resumed, "--max_train_steps", full, "--checkpointing_steps", half,
                     hooks=faults.hooks(stop_after_checkpoint=half))
    assert not (resumed / "model_index.json").exists()  # it died before exporting
    run_training(recipe, resumed, "--max_train_steps", full, "--checkpointing_steps", half,
                 "--resume_from_checkpoint", "latest")
    # It resumed at step `half`: the history holds steps 1 to `full` once each, with the straight run's
    # losses. (What the resume prints is test_resume_from_explicit_path_outside_output_dir's.)
    assert_same_state(straight, resumed, full)


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """The tiny recipe trained 2 steps with checkpoint-2, once per module (per xdist worker):
    tests that resume from it work on a copy (two_step_copy)."""
    folder = tmp_path_factory.mktemp("two_step_run")
    run_training(write_tiny_recipe(folder, checkpointing_steps=2), folder / "run", "--max_train_steps", 2)
    return folder / "run"


@pytest.fixture
def two_step_copy(two_step_run, tmp_path):
    """A copy of two_step_run in this test's folder, free to change."""
    return shutil.copytree(two_step_run, tmp_path / "first")


@pytest.mark.xdist_group("test_resume.two_step_run")
def test_resume_from_explicit_path_outside_output_dir(tiny_recipe, tmp_path, two_step_copy):
    recipe = tiny_recipe(checkpointing_steps=2)
    first = two_step_copy
    moved = tmp_path / "elsewhere" / "my-checkpoint"
    os.makedirs(moved.parent)
    os.rename(first / "checkpoint-2", moved)
    result = run_training(recipe, tmp_path / "second", "--max_train_steps", 4, "--resume_from_checkpoint", moved)
    assert f"resumed from {moved} at optimizer step 2" in result.stdout
    assert [h["step"] for h in read_history(tmp_path / "second")] == [3, 4]


def test_latest_without_checkpoint_starts_fresh_and_says_so(tiny_recipe, tmp_path):
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2,
                          "--resume_from_checkpoint", "latest")
    assert "no checkpoint in" in result.stdout and "starting a fresh run" in result.stdout


def test_kill_while_writing_checkpoint_resumes_from_previous(tiny_recipe, tmp_path):
    """SIGKILL the trainer's process inside the second checkpoint save (after accelerate wrote its
    files, before the completion marker): the tmp folder is ignored and checkpoint-2 is used."""
    out = tmp_path / "run"
    recipe = tiny_recipe(checkpointing_steps=2)
    killed = launch_training(recipe, out, "--max_train_steps", 6, faults=("--sigkill_in_save", 4), check=False)
    assert killed.returncode == -9
    assert sorted(os.listdir(out)).count("checkpoint-2") == 1 and not (out / "checkpoint-4").exists()
    assert (out / ".checkpoint-4.tmp" / "model.safetensors").exists()  # the half-written one
    result = run_training(recipe, out, "--max_train_steps", 6, "--resume_from_checkpoint", "latest")
    assert "at optimizer step 2" in result.stdout
    assert (out / "checkpoint-4" / "checkpoint_complete.json").exists() and not (out / ".checkpoint-4.tmp").exists()


def test_truncated_newest_checkpoint_falls_back_with_warning(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    recipe = tiny_recipe(checkpointing_steps=2)
    run_training(recipe, out, "--max_train_steps", 4)
    weights = out / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    explicit = run_training(recipe, tmp_path / "other", "--max_train_steps", 6,
                            "--resume_from_checkpoint", out / "checkpoint-4", check=False)
    assert explicit.returncode == 2 and "cannot be used" in explicit.stderr and "truncated" in explicit.stderr
    result = run_training(recipe, out, "--max_train_steps", 6, "--resume_from_checkpoint", "latest")
    assert "skipping" in result.stderr and "checkpoint-4" in result.stderr and "truncated" in result.stderr
    assert "at optimizer step 2" in result.stdout
    # the resumed run wrote a complete checkpoint-4 of its own in place of the damaged one
    assert checkpointing.verify_checkpoint(str(out / "checkpoint-4")) is None


def test_total_limit_keeps_newest(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(checkpointing_steps=1, checkpoints_total_limit=2), out, "--max_train_steps", 5)
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-5"]
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


@pytest.mark.xdist_group("test_resume.two_step_run")
def test_state_breaking_change_is_refused_with_the_differences(tiny_recipe, two_step_copy):
    out = two_step_copy
    # one refusal names every difference the saved state cannot serve, each with its old and new value
    result = run_training(tiny_recipe(checkpointing_steps=2, prediction_type="v_prediction", train_batch_size=4),
                          out, "--max_train_steps", 4, "--resume_from_checkpoint", "latest", "--diagnostics_bins", 5,
                          check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [refusal] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "prediction_type: 'epsilon' -> 'v_prediction'" in refusal
    assert "train_batch_size: 8 -> 4" in refusal
    assert "diagnostics_bins: 10 -> 5" in refusal
    harmless = run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 3,
                            "--resume_from_checkpoint", "latest", "--diagnostics_steps", 3, "--ema_max_decay", 0.5)
    # each applied change is one line of the output, naming the step it takes effect from
    assert "resuming with --ema_max_decay 0.5 (was 0.999): applied from step 3" in harmless.stdout
    assert "Warning" not in harmless.stderr


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """2-rank runs of the tiny recipe at batch 4 per rank, once per module: "straight" (6 steps,
    checkpoints 3 and 6, dropout 0.1), "resumed" (the same, killed after checkpoint-3 and resumed),
    "two" (4 steps, no dropout) and "single" (1 process at batch 8, no dropout). Read them, or copy."""
    folder = tmp_path_factory.mktemp("two_rank_runs")
    recipe = write_tiny_recipe(folder, checkpointing_steps=3, train_batch_size=4,
                               model={**_tiny_model(), "dropout": 0.1})
    env = {"ACCELERATE_USE_CPU": "1"}
    runs = {name: folder / name for name in ("straight", "resumed", "two", "single")}
    two_ranks = functools.partial(launch_training, ranks=2, env=env)
    runs["straight_stdout"] = two_ranks(recipe, runs["straight"], "--max_train_steps", 6).stdout
    two_ranks(recipe, runs["resumed"], "--max_train_steps", 6, faults=("--stop_after_checkpoint", 3))
    runs["ranks_saved_at_3"] = set(os.listdir(runs["resumed"] / "checkpoint-3"))
    runs["exported_before_the_resume"] = (runs["resumed"] / "model_index.json").exists()  # the cut-off run did not
    two_ranks(recipe, runs["resumed"], "--max_train_steps", 6, "--resume_from_checkpoint", "latest")
    # one process with the same global batch of 8, dropout off in both for a like-for-like check
    two_ranks(write_tiny_recipe(folder, checkpointing_steps=3, train_batch_size=4), runs["two"], "--max_train_steps", 4)
    run_training(write_tiny_recipe(folder, checkpointing_steps=3, train_batch_size=8), runs["single"],
                 "--max_train_steps", 4)
    return runs


@pytest.mark.xdist_group("test_resume.two_rank_runs")
def test_two_ranks_train_checkpoint_resume_and_match_one_rank(two_rank_runs):
    """2 gloo ranks x batch 4 == 1 rank x batch 8 (same data, noise, timesteps), resume restores
    every rank's RNG (dropout on), and the ranks' replicas agree."""
    runs = two_rank_runs
    assert "replicas identical on 2 processes" in runs["straight_stdout"]
    assert {f"random_states_{r}.pkl" for r in (0, 1)} <= runs["ranks_saved_at_3"]
    assert not runs["exported_before_the_resume"]  # the ranks died after checkpoint-3: the resume did the rest
    assert_same_state(runs["straight"], runs["resumed"], 6)
    w2, w1 = load_unet_weights(runs["two"]), load_unet_weights(runs["single"])
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    l2, l1 = read_history(runs["two"]), read_history(runs["single"])
    assert [h["loss"] for h in l2] == pytest.approx([h["loss"] for h in l1], rel=1e-5)
    assert [h["lr"] for h in l2] == [h["lr"] for h in l1]  # the schedule counts optimizer steps, not ranks


@pytest.mark.xdist_group("test_resume.two_rank_runs")
def test_resume_with_other_process_count_is_refused(tiny_recipe, tmp_path, two_rank_runs):
    out = shutil.copytree(two_rank_runs["two"], tmp_path / "run")  # a 2-process run with checkpoint-3
    recipe = tiny_recipe(checkpointing_steps=3, train_batch_size=4)
    result = run_training(recipe, out, "--max_train_steps", 6, "--resume_from_checkpoint", "latest", check=False)
    assert result.returncode == 2 and "num_processes: 2 -> 1" in result.stderr


def _tiny_model():
    from helpers import TINY_RECIPE
    return dict(TINY_RECIPE["model"])


@pytest.mark.usefixtures("fresh_accelerate")
def test_a_checkpoint_name_resumes_from_the_output_dir_as_in_diffusers(tiny_recipe, tmp_path, monkeypatch):
    """diffusers' train_unconditional.py reads `--resume_from_checkpoint checkpoint-1` as that folder
    of --output_dir, whatever the working directory; the same command line resumes here."""
    recipe, out = tiny_recipe(checkpointing_steps=1), tmp_path / "run"
    run_training(recipe, out, "--max_train_steps", 1)
    monkeypatch.chdir(tmp_path / "..")  # nothing named checkpoint-1 here
    resumed = run_training(recipe, out, "--max_train_steps", 2, "--resume_from_checkpoint", "checkpoint-1")
    assert f"resumed from {out / 'checkpoint-1'} at optimizer step 1" in resumed.stdout
    assert checkpointing.list_checkpoints(str(out)) == [str(out / "checkpoint-1"), str(out / "checkpoint-2")]
    refused = run_training(recipe, out, "--max_train_steps", 3, "--resume_from_checkpoint", "checkpoint-9", check=False)
    assert refused.returncode == 2
    assert (f"error: --resume_from_checkpoint checkpoint-9: no such checkpoint folder {out / 'checkpoint-9'}"
            in refused.stderr)
