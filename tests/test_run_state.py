"""The typed run state: what the run derives lives in run_state.Plan (the config stays as the
user gave it, the saved config records the derived values), images seen have one formula, and
the embedded digits switch the held-out and gradient probes on."""
import copy
import dataclasses

import pytest
import torch
import yaml
from helpers import read_history, run_training, tiny_run

from diffusion_extras.training import compat, loop, run_state
from diffusion_extras.training.config import TrainConfig, parse_config


def test_setup_leaves_the_config_as_given_and_the_saved_config_records_the_plan(tmp_path, fresh_accelerate):
    # epochs decide the length; diffusers' epoch intervals become steps; no model chosen
    run = tiny_run(tmp_path, "--num_epochs", 2, "--save_images_epochs", 1, "--gradient_accumulation_steps", 2,
                   max_train_steps=None, save_images_steps=1000)
    given = copy.deepcopy(run.config)
    assert given.max_train_steps is None and given.save_images_steps == 1000
    # 64 images, batch 8, accumulation 2: 4 optimizer steps per epoch
    assert (run.plan.max_train_steps, run.plan.save_images_steps) == (8, 4)
    loop.train(run)
    assert run.config == given, "the run changed its config"
    saved = yaml.safe_load((tmp_path / "run" / "training_config.yaml").read_text())
    assert (saved["max_train_steps"], saved["save_images_steps"], saved["num_epochs"]) == (8, 4, 2)
    assert saved["model"] == run.plan.model and saved["validation_split"] == 0.0
    # the checkpoint's record of the config (the resume check) holds the real length too
    assert run.learner.state_config["max_train_steps"] == 8
    # and the saved config reproduces the run's plan
    again = parse_config(["--config", str(tmp_path / "run" / "training_config.yaml")])
    assert again.max_train_steps == 8 and again.save_images_steps == 4


def test_epoch_intervals_do_not_touch_the_config():
    config = TrainConfig(save_images_epochs=3, save_model_steps=7)
    intervals, lines = compat.epoch_intervals(config, steps_per_epoch=5)
    assert intervals == {"save_images_steps": 15, "save_model_steps": 7}
    assert lines == ["--save_images_epochs 3 -> --save_images_steps 15 (5 optimizer steps per epoch) from step 5, "
                     "the end of the first epoch, as diffusers"]
    assert config.save_images_steps == TrainConfig().save_images_steps


def test_epoch_intervals_save_where_diffusers_saves():
    """train_unconditional.py saves after epoch `epoch` (0-based) when `epoch % N == 0 or epoch ==
    num_epochs - 1`; the steps mapped from --save_*_epochs N are due at the ends of those epochs."""
    from diffusion_extras.training.periodic import interval_due
    steps_per_epoch, num_epochs, every = 5, 10, 3
    diffusers = [(epoch + 1) * steps_per_epoch for epoch in range(num_epochs)
                 if epoch % every == 0 or epoch == num_epochs - 1]
    last = num_epochs * steps_per_epoch
    ours = [step for step in range(1, last + 1)
            if interval_due(every * steps_per_epoch, step, step == last, epochs=every)]
    assert ours == diffusers == [5, 20, 35, 50]
    assert [step for step in range(1, 13) if interval_due(4, step, step == 12)] == [4, 8, 12]  # steps: no phase
    assert not any(interval_due(0, step, step == 12) for step in range(1, 13))  # 0: never, the end neither


def test_images_seen_counts_processes_and_accumulation():
    data = run_state.Data(source=None, sigma_data=0.5, global_micro_batch_size=16, gradient_accumulation_steps=3)
    assert data.images_seen(10) == 10 * 3 * 16


@pytest.mark.parametrize("flags, embedded, expected", [
    ({}, True, {"validation_split": 0.05, "grad_diagnostics_steps": 250}),
    ({}, False, {"validation_split": 0.0, "grad_diagnostics_steps": 0}),
    ({"validation_split": 0.0, "grad_diagnostics_steps": 0}, True,
     {"validation_split": 0.0, "grad_diagnostics_steps": 0}),
    ({"validation_split": 0.2, "validation_steps": 50}, False, {"validation_split": 0.2, "grad_diagnostics_steps": 0}),
    ({"validation_steps": 50}, True, {"validation_split": 0.05, "grad_diagnostics_steps": 50}),
])
def test_probes_are_on_for_the_embedded_digits_unless_set(flags, embedded, expected):
    assert run_state.extras_switches(TrainConfig(**flags), embedded) == expected


def test_plan_fields_are_config_fields():
    """resolved_config overwrites config fields by name: a Plan field without one would add a
    key that --config refuses when the saved config is loaded again."""
    config_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {f.name for f in dataclasses.fields(run_state.Plan)} <= config_fields


def test_the_digits_default_run_writes_the_held_out_and_gradient_plots(tmp_path):
    """No data flag: the held-out loss (5 % of the digits, never trained on) and the gradient
    monitor run at --validation_steps; user data (a folder here) gets neither unless asked."""
    out = tmp_path / "digits"
    run_training(_small_digits_recipe(tmp_path), out, "--max_train_steps", 4, "--validation_steps", 2, "--resolution",
                 8, "--train_batch_size", 8, "--eval_batch_size", 2, "--ddpm_num_inference_steps", 2, "--logger",
                 "none")
    history = read_history(out)
    probes = [row["step"] for row in history if "grad_probe/total_norm" in row]
    held_out = [row for row in history if "validation/raw_loss" in row]
    assert probes == [2, 4] and [row["step"] for row in held_out] == [2, 4]
    shares = [held for held in history if "grad_probe/total_norm" in held][-1]
    assert sum(v for k, v in shares.items() if k.startswith("grad_probe/share_bin/")) == pytest.approx(1.0, abs=1e-6)
    assert all(torch.isfinite(torch.tensor(row["validation/ema_loss"])) for row in held_out)
    for plot in ("held_out_loss.png", "grad_per_timestep.png"):
        assert (out / "images" / plot).stat().st_size > 10_000
    saved = yaml.safe_load((out / "training_config.yaml").read_text())
    assert (saved["validation_split"], saved["grad_diagnostics_steps"]) == (0.05, 2)


def _small_digits_recipe(tmp_path) -> str:
    """The digits recipe's data and flags with the tiny UNet (the default model is 1.1M parameters)."""
    from helpers import TINY_RECIPE
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({"model": TINY_RECIPE["model"]}))
    return str(path)
