"""Tests for diffusion_extras/monitoring/held_out.py and report_dynamics.py: the held-out per-timestep loss
with raw and EMA weights through the training command line, and its health checks."""
import json

import numpy as np
import pytest
from diffusers import DDPMScheduler, UNet2DModel
from helpers import read_history, run_cli, run_training

from diffusion_extras.core.objectives import DDPM
from diffusion_extras.data import batch_order, decode_cache
from diffusion_extras.data import images as data
from diffusion_extras.monitoring import held_out as validation
from diffusion_extras.report.checks import RunLog
from diffusion_extras.report.dynamics import check_ema_behind_raw, check_held_out_overfitting
from diffusion_extras.training.config import parse_config


def test_split_is_seeded_disjoint_and_complete():
    images = decode_cache.DecodedImages(np.arange(20 * 4, dtype=np.uint8), np.full((20, 2), 2), np.arange(20) * 4, 1)
    train_part, held = batch_order.split_held_out(images, 0.25, seed=3)
    assert (len(train_part), len(held)) == (15, 5)
    assert sorted(np.concatenate([train_part.rows, held.rows]).tolist()) == list(range(20))
    np.testing.assert_array_equal(held.image(0), images.image(int(held.rows[0])))
    assert batch_order.split_held_out(images, 0.25, seed=3)[1].rows.tolist() == held.rows.tolist()
    assert batch_order.split_held_out(images, 0.25, seed=4)[1].rows.tolist() != held.rows.tolist()


def test_training_logs_raw_and_ema_held_out_loss_per_bin_with_fixed_noise(tiny_recipe, tmp_path):
    out, recipe = tmp_path / "run", tiny_recipe()
    run_training(recipe, out, "--max_train_steps", 6, "--validation_split", 0.25, "--validation_steps", 3)
    rows = [r for r in read_history(out) if "validation/raw_loss" in r]
    assert [r["step"] for r in rows] == [3, 6]
    for row in rows:
        for kind in ("raw", "ema"):
            bins = [row[f"validation/{kind}_bin/{i:02d}"] for i in range(10)]
            assert all(np.isfinite(bins)) and row[f"validation/{kind}_loss"] == pytest.approx(np.mean(bins))
    assert (out / "images" / "held_out_loss.png").stat().st_size > 10_000

    # The logged EMA numbers are the held-out loss of the exported (EMA) weights on the same split,
    # noise and timesteps: recomputed here from the saved pipeline, they agree.
    config = parse_config(["--config", recipe, "--output_dir", str(out), "--validation_split", "0.25"])
    dataset = data.load_image_dataset(config)
    images = decode_cache.cached_decode(dataset, data.find_image_column(dataset), 8, True, 1, str(tmp_path / "cache"))
    _, held = batch_order.split_held_out(images, 0.25, config.seed)
    held_out = validation.HeldOutLoss(held, 8, 1000, 10, config.seed, config.train_batch_size)
    unet = UNet2DModel.from_pretrained(out / "unet")
    objective = DDPM(DDPMScheduler.from_pretrained(out / "scheduler"))
    first = held_out.per_bin_loss(unet, objective, "cpu")
    np.testing.assert_allclose(first, [rows[-1][f"validation/ema_bin/{i:02d}"] for i in range(10)], rtol=1e-5)
    np.testing.assert_array_equal(first, held_out.per_bin_loss(unet, objective, "cpu"))  # fixed noise
    # EMA still warming up after 6 steps: the report says the EMA is behind the raw weights.
    assert rows[-1]["validation/ema_loss"] > 1.01 * rows[-1]["validation/raw_loss"]
    assert "ema_behind_raw" in (out / "training_report.md").read_text()


def test_held_out_loss_is_off_by_default_and_without_ema_logs_raw_only(tiny_recipe, tmp_path):
    run_training(tiny_recipe(), tmp_path / "off", "--max_train_steps", 2)
    assert not any("validation/raw_loss" in r for r in read_history(tmp_path / "off"))
    run_training(tiny_recipe(), tmp_path / "raw", "--max_train_steps", 2, "--validation_split", 0.25, "--no-use_ema")
    rows = [r for r in read_history(tmp_path / "raw") if "validation/raw_loss" in r]
    assert len(rows) == 1 and not any(key.startswith("validation/ema") for key in rows[0])


@pytest.mark.parametrize("flags, message", [
    (["--validation_split", "0.999"], "--validation_split 0.999 of 64 images leaves 64 held out"),
    (["--validation_split", "1.5"], "--validation_split must lie in [0, 1)"),
    (["--validation_split", "0.1", "--streaming", "--dataset_name", "x"], "--validation_split needs cached data"),
])
def test_bad_validation_split_is_a_one_line_error_before_training(tiny_recipe, tmp_path, flags, message):
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2, *flags, check=False)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "unet").exists()


def history(held_out, training, ema=None):
    """Windows of training loss at steps 10, 20, ...; a held-out evaluation every 4th window."""
    rows = [{"step": 10 * (i + 1), "loss": loss} for i, loss in enumerate(training)]
    for k, value in enumerate(held_out):
        rows.append({"step": 40 * (k + 1), "validation/raw_loss": value,
                     **({"validation/ema_loss": ema[k]} if ema else {})})
    return rows


def test_overfitting_is_reported_when_held_out_rises_while_training_falls(tmp_path):
    training = list(np.geomspace(1.0, 0.2, 16))
    (tmp_path / "logs").mkdir()
    with open(tmp_path / "logs" / "history.jsonl", "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in history([0.5, 0.4, 0.45, 0.5], training))
    printed = run_cli(["-m", "diffusion_extras.report", tmp_path]).stdout
    assert "overfitting" in printed and "step 80" in printed and "--max_train_steps 80" in printed
    config = {"max_train_steps": 160}
    assert not check_held_out_overfitting(RunLog(history([0.5, 0.4, 0.35, 0.3], training), config))  # generalising
    flat = [0.3] * 16
    assert not check_held_out_overfitting(RunLog(history([0.5, 0.4, 0.45, 0.5], flat), config))  # training not falling


def test_ema_behind_raw_is_a_warning_only_at_the_end_of_the_run():
    training, config = list(np.geomspace(1.0, 0.2, 16)), {"max_train_steps": 160, "ema_max_decay": 0.999}
    behind = history([0.5, 0.4, 0.3, 0.3], training, ema=[0.6, 0.5, 0.4, 0.35])
    (finding,) = check_ema_behind_raw(RunLog(behind, config))
    assert finding.severity == "warning" and "--ema_max_decay 0.9375" in finding.recommendation
    assert check_ema_behind_raw(RunLog(behind, {**config, "max_train_steps": 1000}))[0].severity == "info"
    ahead = history([0.5, 0.4, 0.3, 0.3], training, ema=[0.6, 0.5, 0.3, 0.29])
    assert not check_ema_behind_raw(RunLog(ahead, config))
