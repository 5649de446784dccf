"""Resume policies (refuse / apply / free, read from the config fields), applied changes through
the trainer's command line (its main() in this process), rollback without loss, and torn-file detection."""
import json
import os
import shutil
from dataclasses import fields

import pytest
import torch
from helpers import cosine_lr, optimizer_state, read_history, run_training, write_tiny_recipe

from diffusion_extras.training import checkpointing
from diffusion_extras.training.config import RESUME_POLICIES, TrainConfig, resume_policy


# ----------------------------------------------------------------------------- policy as data
def test_every_field_declares_a_valid_resume_policy():
    missing = [f.name for f in fields(TrainConfig) if f.metadata.get("resume") not in RESUME_POLICIES]
    assert not missing, f"fields without a valid resume policy (refuse/apply/free): {missing}"
    assert resume_policy("learning_rate") == "apply" and resume_policy("prediction_type") == "refuse"


def test_every_recorded_key_has_a_policy_and_the_check_reads_it():
    policies = checkpointing.resume_policies()
    assert {f.name for f in fields(TrainConfig)} | {"unet", "num_processes", "pretrained", "vae"} == set(policies)
    assert not hasattr(checkpointing, "STATE_SHAPING_KEYS") and not hasattr(checkpointing, "RUN_CHANGING_KEYS")
    saved = {"learning_rate": 1e-3, "resolution": 16, "output_dir": "a", "unet": {"sample_size": 16},
             "num_processes": 2, "rescale_betas_zero_snr": False, "use_8bit_adam": False}
    current = {"learning_rate": 1e-5, "resolution": 16, "output_dir": "b", "unet": {"sample_size": 32},
               "num_processes": 2, "rescale_betas_zero_snr": True, "use_8bit_adam": True, "new_setting": 1}
    changes = checkpointing.compare_configs(saved, current)
    assert set(changes["refuse"]) == {"unet", "rescale_betas_zero_snr", "use_8bit_adam"}
    assert changes["apply"] == {"learning_rate": (1e-3, 1e-5)}
    assert changes["free"] == {"output_dir": ("a", "b")}


# ----------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """4 steps at lr 1e-3 (cosine, 2 warmup steps over 4), checkpoints 2 and 4: shared, copied per test."""
    work = tmp_path_factory.mktemp("base")
    recipe = write_tiny_recipe(work, checkpointing_steps=2)
    run_training(recipe, work / "run", "--max_train_steps", 4)
    return recipe, work / "run"


def copy_of(base, tmp_path):
    recipe, run = base
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return recipe, out


@pytest.mark.xdist_group("test_resume_policy.base")
def test_changed_lr_weight_decay_and_betas_apply_from_the_first_resumed_step(base, tmp_path):
    recipe, out = copy_of(base, tmp_path)
    shutil.rmtree(out / "checkpoint-4")  # a run cut off after checkpoint-2
    flags = ["--learning_rate", 1e-5, "--adam_weight_decay", 0.5, "--adam_beta1", 0.8, "--adam_beta2", 0.99,
             "--adam_epsilon", 1e-6]
    result = run_training(recipe, out, "--max_train_steps", 4, "--resume_from_checkpoint", "latest", *flags)
    assert "resuming with --learning_rate 1e-05 (was 0.001): applied from step 3" in result.stdout
    assert "resuming with --adam_weight_decay 0.5 (was 0.0): applied from step 3" in result.stdout
    assert "resuming with --adam_beta1 0.8 (was 0.9)" in result.stdout
    assert "Warning" not in result.stderr  # the lines only, not a Python warning (file, line) repeating them
    history = {h["step"]: h["lr"] for h in read_history(out)}
    assert history[1] == 0.0 and history[2] == pytest.approx(5e-4)  # the first run's own schedule
    assert history[3] == pytest.approx(cosine_lr(1e-5, 2, 2, 4))
    assert history[4] == pytest.approx(cosine_lr(1e-5, 3, 2, 4))
    optimizer = optimizer_state(out / "checkpoint-4")
    [group] = optimizer["param_groups"]
    assert group["weight_decay"] == 0.5 and tuple(group["betas"]) == (0.8, 0.99) and group["initial_lr"] == 1e-5
    assert group["eps"] == 1e-6
    assert {float(s["step"]) for s in optimizer["state"].values()} == {4.0}, "Adam's moments were not kept"
    # the next resume compares with checkpoint-4's own recorded config: the applied values
    recorded = json.loads((out / "checkpoint-4" / "train_state.json").read_text())["config"]
    assert recorded["learning_rate"] == 1e-5 and recorded["adam_weight_decay"] == 0.5
    again = run_training(recipe, out, "--max_train_steps", 5, "--resume_from_checkpoint", "latest", *flags)
    assert "resuming with --learning_rate" not in again.stdout and "--adam_beta1" not in again.stderr


@pytest.mark.xdist_group("test_resume_policy.base")
def test_rollback_with_total_limit_keeps_the_abandoned_future(base, tmp_path):
    """A rollback under a total limit: checkpoint-2 and checkpoint-4, resume from checkpoint-2 with
    --checkpointing_steps 1 --checkpoints_total_limit 1 --max_train_steps 3."""
    recipe, out = copy_of(base, tmp_path)
    result = run_training(recipe, out, "--resume_from_checkpoint", out / "checkpoint-2",
                          "--checkpointing_steps", 1, "--checkpoints_total_limit", 1, "--max_train_steps", 3)
    [abandoned] = [n for n in os.listdir(out) if n.startswith("abandoned-2-")]
    assert f"moved to {out / abandoned}" in result.stdout and "nothing was deleted" in result.stdout
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-3"]
    assert checkpointing.verify_checkpoint(str(out / abandoned / "checkpoint-4")) is None
    abandoned_history = (out / abandoned / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in abandoned_history] == [1, 2, 3, 4]
    assert [h["step"] for h in read_history(out)] == [1, 2, 3]


@pytest.mark.xdist_group("test_resume_policy.base")
def test_rollback_without_limit_latest_never_picks_the_abandoned_future(base, tmp_path):
    """Also resumes with --scale_lr: the peak becomes 1e-3 x batch 8 from the first resumed step."""
    recipe, out = copy_of(base, tmp_path)
    result = run_training(recipe, out, "--resume_from_checkpoint", out / "checkpoint-2",
                          "--checkpointing_steps", 1, "--max_train_steps", 3, "--scale_lr")
    assert "resuming with --scale_lr True (was False): applied from step 3" in result.stdout
    assert read_history(out)[2]["lr"] == pytest.approx(cosine_lr(8e-3, 2, 2, 3))
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    assert checkpointing.resume_candidates(str(out), "latest")[0] == str(out / "checkpoint-3")
    [abandoned] = [n for n in os.listdir(out) if n.startswith("abandoned-")]
    assert os.listdir(out / abandoned / "checkpoint-4")


@pytest.mark.xdist_group("test_resume_policy.base")
def test_same_size_torn_file_is_caught_and_latest_falls_back(base, tmp_path):
    recipe, out = copy_of(base, tmp_path)
    optimizer = out / "checkpoint-4" / "optimizer.bin"
    payload = bytearray(optimizer.read_bytes())
    payload[len(payload) // 2:len(payload) // 2 + 64] = bytes(64)  # zeroed like a torn page: same size
    optimizer.write_bytes(bytes(payload))
    assert "does not match the checksum" in checkpointing.verify_checkpoint(str(out / "checkpoint-4"))
    result = run_training(recipe, out, "--max_train_steps", 5, "--resume_from_checkpoint", "latest")
    assert "skipping" in result.stderr and "optimizer.bin does not match the checksum" in result.stderr
    assert "at optimizer step 2" in result.stdout


@pytest.mark.xdist_group("test_resume_policy.base")
def test_precision_no_to_bf16_and_back_resumes_and_changes_the_numerics(base, tmp_path):
    recipe, out = copy_of(base, tmp_path)
    shutil.rmtree(out / "checkpoint-4")
    straight = [h["loss"] for h in read_history(base[1])]
    result = run_training(recipe, out, "--max_train_steps", 4, "--mixed_precision", "bf16",
                          "--resume_from_checkpoint", "latest")
    assert "resuming with --mixed_precision bf16 (was no): applied from step 3" in result.stdout
    resumed = [h["loss"] for h in read_history(out)]
    assert resumed[:2] == straight[:2] and resumed[2] != straight[2], "bf16 autocast did not take effect"
    back = run_training(recipe, out, "--max_train_steps", 5, "--mixed_precision", "no",
                        "--resume_from_checkpoint", "latest")
    assert "resuming with --mixed_precision no (was bf16): applied from step 5" in back.stdout


# ----------------------------------------------------------------------------- GradScaler files
def test_precision_changes_around_fp16_load_with_a_fresh_or_dropped_scaler(tmp_path, fresh_accelerate):
    """fp16 needs a GPU, so its GradScaler is stood in for by a CPU one: a checkpoint saved without
    fp16 (no scaler.pt) loads into an fp16 run with a fresh scaler, and an fp16 checkpoint's
    scaler.pt is ignored by a run without one."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    without = checkpointing.save_checkpoint(accelerator, str(tmp_path), 1, {"global_step": 1})
    assert not os.path.exists(os.path.join(without, "scaler.pt"))
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # the fp16 run's
    with pytest.raises(FileNotFoundError):
        accelerator.load_state(without)  # what accelerate alone does
    assert checkpointing.load_state(accelerator, without) is True
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() == 1024.0
    accelerator.scaler.scale(torch.ones(()))  # initialises the scale tensor
    accelerator.scaler.update(2048.0)
    with_scaler = checkpointing.save_checkpoint(accelerator, str(tmp_path), 2, {"global_step": 2})
    assert torch.load(os.path.join(with_scaler, "scaler.pt"))["scale"] == 2048.0
    accelerator.scaler = None  # fp16 -> bf16 / no
    assert checkpointing.load_state(accelerator, with_scaler) is False


def test_only_the_main_process_saves_the_gradscaler():
    """accelerate writes scaler.pt from every rank to one path; the other ranks save without it."""
    from types import SimpleNamespace
    seen = []
    for main in (True, False):
        scaler = object()
        accelerator = SimpleNamespace(scaler=scaler, is_main_process=main)
        accelerator.save_state = lambda path, a=accelerator: seen.append(a.scaler)
        with checkpointing._scaler_saved_by_main_process_only(accelerator):
            accelerator.save_state("x")
        assert accelerator.scaler is scaler  # restored for training
        assert seen[-1] is (scaler if main else None)
