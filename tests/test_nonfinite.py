"""NaN / Inf guard, through the trainer's command line (its main() in this process) with non-finite
inputs injected by faults.hooks(nan_at_steps=...)."""
import json
import os

import faults
import torch
from helpers import read_history, run_training
from safetensors.torch import load_file


def checkpoint_state(folder):
    model = load_file(os.path.join(folder, "model.safetensors"))
    ema = torch.load(os.path.join(folder, "custom_checkpoint_1.pkl"), weights_only=True)["shadow_params"]
    optimizer = torch.load(os.path.join(folder, "optimizer.bin"), weights_only=False)
    steps = [float(s["step"]) for s in optimizer["state"].values()]
    return model, ema, steps


def test_nonfinite_steps_are_skipped_and_training_continues(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    result = run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 6,
                          hooks=faults.hooks(nan_at_steps=(3, 4)))
    m2, e2, s2 = checkpoint_state(out / "checkpoint-2")
    m4, e4, s4 = checkpoint_state(out / "checkpoint-4")
    assert all(torch.equal(m2[k], m4[k]) for k in m2), "a skipped step changed the weights"
    assert all(torch.equal(a, b) for a, b in zip(e2, e4)), "a skipped step changed the EMA"
    assert s2 == s4 and set(s2) == {2.0}, "a skipped step advanced Adam's step count"
    history = read_history(out)
    skipped = {h["step"]: h["nonfinite_steps"] for h in history}
    assert skipped[3] == 1 and skipped[4] == 1 and skipped[5] == 0
    assert "non-finite step(s) skipped" in result.stderr and "inputs of the last one: mean nan" in result.stderr
    assert "timestep bins with non-finite losses: ['" in result.stderr
    final = load_file(out / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.isfinite(w).all() for w in final.values())
    report = json.loads((out / "training_report.json").read_text())
    assert "nonfinite_events" in {f["code"] for f in report["findings"]}


def test_consecutive_nonfinite_steps_stop_with_last_good_checkpoint(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    result = run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 20,
                          "--max_nonfinite_steps", 3, hooks=faults.hooks(nan_at_steps=range(3, 21)),
                          check=False)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "error: stopped: 3 consecutive non-finite steps by step 5" in result.stderr
    assert "Traceback" not in result.stderr
    m2, e2, _ = checkpoint_state(out / "checkpoint-2")
    m5, e5, _ = checkpoint_state(out / "checkpoint-5")
    assert all(torch.equal(m2[k], m5[k]) for k in m2) and all(torch.equal(a, b) for a, b in zip(e2, e5))
    report = json.loads((out / "training_report.json").read_text())
    [finding] = [f for f in report["findings"] if f["code"] == "nonfinite_events"]
    assert finding["severity"] == "critical"
