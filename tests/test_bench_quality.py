"""bench/quality.py end to end on the tiny recipe: a step budget and a time budget each give a
complete report with the classifier FID and the real-data floor. No figure is asserted beyond
sanity: they are measurements."""
import json
import math
import os

import numpy as np
from conftest import run_command


def run_quality(tmp_path, *args):
    return run_command([os.path.join("bench", "quality.py"), *args], tmp_path, timeout=600)


def test_step_budget_reports_classifier_fid_and_the_real_data_floor(tmp_path, tiny_recipe):
    out = tmp_path / "quality"
    result = run_quality(tmp_path, "--max_train_steps", "3", "--num_samples", "24", "--config", tiny_recipe(),
                         "--out", str(out), "--", "--learning_rate", "2e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["steps"] == 3 and report["extra_flags"] == ["--learning_rate", "2e-3"]
    assert all(math.isfinite(report[k]) and report[k] > 0 for k in ("fid_classifier", "floor", "train_seconds"))
    assert report["held_out_images"] == 13  # round(0.2 x 64): the run's own held-out split
    history = [json.loads(line) for line in open(out / "run-3" / "logs" / "history.jsonl")]
    assert any("validation/raw_loss" in row for row in history)  # trained with the split held out
    assert "real-data floor" in result.stdout


def test_time_budget_calibrates_then_trains_the_steps_that_fit(tmp_path, tiny_recipe):
    out = tmp_path / "quality"
    result = run_quality(tmp_path, "--time_budget", "45", "--calibration_steps", "4", "--num_samples", "16",
                         "--config", tiny_recipe(max_train_samples=32), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    budget = report["time_budget"]
    expected = int((45 - budget["startup_seconds"]) / budget["seconds_per_step"])
    assert report["steps"] == budget["steps"] == max(1, expected) and np.isfinite(report["fid_classifier"])
    assert (out / f"run-{report['steps']}" / "model_index.json").is_file()
