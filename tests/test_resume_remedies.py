"""Every remedy the product prints with "then resume" is a path that works: a non-finite stop is
provoked (NaN inputs injected by faults.hooks(nan_at_steps=...)), then the run is resumed with exactly
the change the message or the health report names, and the change is seen to take effect."""
import json
import re
import shutil

import faults
import pytest
from helpers import cosine_lr, optimizer_state, read_history, run_training, write_tiny_recipe

# Every test here reads `stopped` (module-scoped): on one xdist worker (--dist loadgroup) it is made once.
pytestmark = pytest.mark.xdist_group("test_resume_remedies.stopped")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Clipping off, NaN inputs from step 3: stops at step 5 (3 in a row) with checkpoints 2, 4, 5."""
    work = tmp_path_factory.mktemp("stopped")
    recipe = write_tiny_recipe(work, checkpointing_steps=2)
    result = run_training(recipe, work / "run", "--max_train_steps", 8, "--max_grad_norm", 0,
                          "--max_nonfinite_steps", 3, hooks=faults.hooks(nan_at_steps=range(3, 9)), check=False)
    assert result.returncode == 3, result.stderr[-3000:]
    return recipe, work / "run", result.stderr


def test_nonfinite_stop_message_remedies_apply_on_resume(stopped, tmp_path):
    recipe, run, stderr = stopped
    assert ("Lower --learning_rate (now 0.001) or set --max_grad_norm 1.0, then resume with "
            "--resume_from_checkpoint latest") in stderr
    assert "--mixed_precision bf16" not in stderr  # only said to fp16 runs, where it applies
    out = tmp_path / "run"
    shutil.copytree(run, out)
    result = run_training(recipe, out, "--max_train_steps", 8, "--max_nonfinite_steps", 3, "--learning_rate", 5e-4,
                          "--max_grad_norm", 1.0, "--resume_from_checkpoint", "latest")
    assert "at optimizer step 5" in result.stdout
    assert "resuming with --learning_rate 0.0005 (was 0.001): applied from step 6" in result.stdout
    assert "resuming with --max_grad_norm 1.0 (was 0.0): applied from step 6" in result.stdout
    history = {h["step"]: h for h in read_history(out)}
    assert history[6]["lr"] == pytest.approx(cosine_lr(5e-4, 5, 2, 8))
    assert history[1]["clip_rate"] == 0.0  # clipping was off
    assert history[6]["grad_norm"] > 1.0 and history[6]["clip_rate"] == 1.0  # and now clips at 1.0
    assert optimizer_state(out / "checkpoint-8")["param_groups"][0]["initial_lr"] == 5e-4


def test_health_report_stability_recommendation_applies_on_resume(stopped, tmp_path):
    """The report says: resume from a checkpoint before the first bad step; lower --learning_rate
    to X; lengthen --lr_warmup_steps to Y; clip with --max_grad_norm Z. Take it literally."""
    recipe, run, _ = stopped
    report = json.loads((run / "training_report.json").read_text())
    [finding] = [f for f in report["findings"] if f["code"] == "nonfinite_events"]
    fix = finding["recommendation"]
    assert "resume from a checkpoint before it" in fix
    flags = dict(re.findall(r"--(\w+)(?: to)? (\d[\d.e-]*\d)", fix))
    assert flags == {"learning_rate": "0.0005", "lr_warmup_steps": "500", "max_grad_norm": "1.0"}
    first_bad = min(h["step"] for h in read_history(run) if h["nonfinite_steps"] > 0)
    out = tmp_path / "run"
    shutil.copytree(run, out)
    before = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if int(p.name.split("-")[1]) < first_bad)
    result = run_training(recipe, out, "--max_train_steps", 4, "--resume_from_checkpoint", out / f"checkpoint-{before}",
                          *[item for name, value in flags.items() for item in (f"--{name}", value)])
    assert f"at optimizer step {before}" in result.stdout and "abandoned-" in result.stdout
    history = {h["step"]: h for h in read_history(out)}
    assert sorted(history) == [1, 2, 3, 4]
    # the warmup now spans 500 steps: the run re-warms from 2/500 of the new peak
    assert history[3]["lr"] == pytest.approx(5e-4 * 2 / 500) and history[4]["lr"] == pytest.approx(5e-4 * 3 / 500)
    assert history[3]["clip_rate"] == float(history[3]["grad_norm"] > 1.0)
    assert "resuming with --lr_warmup_steps 500 (was 2)" in result.stdout
