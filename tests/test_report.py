import json
import os
import re

import numpy as np
import pytest
import torch
import yaml
from helpers import run_cli

from diffusion_extras.core.ema import ExponentialMovingAverage
from diffusion_extras.monitoring.bins import loss_bin_key
from diffusion_extras.monitoring.diagnostics import TimestepDiagnostics
from diffusion_extras.report import checks as report_checks
from diffusion_extras.report import health as report
from diffusion_extras.report import timestep_balance

SIGMA_DATA = 0.5
NUM_BINS = 10
CONFIG = dict(max_train_steps=20_000, learning_rate=1e-4, lr_warmup_steps=500, use_ema=True,
              ema_max_decay=0.9999, ema_inv_gamma=1.0, ema_power=0.75, max_grad_norm=1.0,
              prediction_type="epsilon", snr_gamma=None, mixed_precision="bf16",
              train_batch_size=64, gradient_accumulation_steps=1, ddpm_num_steps=1000,
              ddpm_beta_schedule="linear")


def _reference(prediction_type="epsilon"):
    from diffusers import DDPMScheduler

    alphas_cumprod = DDPMScheduler(num_train_timesteps=1000).alphas_cumprod
    return TimestepDiagnostics(1000, NUM_BINS).bayes_optimal_bins(alphas_cumprod, SIGMA_DATA, prediction_type)


REFERENCE = _reference()


def _ema_decay(step, config=CONFIG):
    """The decay a run's EMA (core/ema.py, with the config's settings) logs at `step`."""
    ema = ExponentialMovingAverage([torch.zeros(1)], max_decay=config["ema_max_decay"],
                                   inv_gamma=config["ema_inv_gamma"], power=config["ema_power"])
    return ema.decay(step)


def make_history(steps=20_000, every=100, seed=0, loss_noise=0.03, timescale=800.0, config=CONFIG,
                 reference=REFERENCE, **overrides):
    """A healthy run unless `overrides` maps a key to a function of (step, rng, healthy value)."""
    rng = np.random.default_rng(seed)
    history = []
    for step in range(every, steps + 1, every):
        progress = np.exp(-step / timescale)
        record = {"step": step, "loss": (0.05 + 0.9 * progress) * float(np.exp(loss_noise * rng.normal())),
                  "lr": config["learning_rate"] * min(1.0, step / config["lr_warmup_steps"]),
                  "grad_norm": 0.5 + 0.05 * rng.random(), "clip_rate": 0.1, "nonfinite_steps": 0.0,
                  "max_consecutive_nonfinite": 0.0, "ema_decay": _ema_decay(step, config)}
        for key, value in reference.items():
            record[key] = value * (0.8 + 2 * progress) * (1 + 0.02 * rng.normal())
        for key, change in overrides.items():
            record[key] = change(step, rng, record.get(key))
        history.append(record)
    return history


def _serious(findings):
    return {f.code for f in findings if f.severity in ("warning", "critical")}


def test_healthy_run_has_no_warnings():
    findings = report.analyze(make_history(), CONFIG, REFERENCE)
    assert _serious(findings) == set()
    # Its EMA never reached the 0.9999 cap: worth an info line, not a warning.
    assert [(f.code, f.severity) for f in findings] == [("ema_not_warmed_up", "info")]


def test_loss_diverging():
    rising = make_history(loss=lambda s, rng, v: v * (1 + max(0.0, (s - 14_000) / 3_000)))
    findings = report.analyze(rising, CONFIG, REFERENCE)
    assert _serious(findings) == {"loss_diverging"}
    assert findings[0].severity == "critical" and "--learning_rate" in findings[0].recommendation
    nan_at_end = make_history()
    nan_at_end[-1]["loss"] = float("nan")
    assert "loss_diverging" in _serious(report.analyze(nan_at_end, CONFIG, REFERENCE))


def test_loss_stuck():
    flat = make_history(loss=lambda s, rng, v: 1.0 * float(np.exp(0.02 * rng.normal())))
    findings = report.analyze(flat, CONFIG, REFERENCE)
    assert _serious(findings) == {"loss_stuck"}
    assert "--learning_rate" in findings[0].recommendation


def test_loss_noisy():
    findings = report.analyze(make_history(loss_noise=0.4), CONFIG, REFERENCE)
    assert _serious(findings) == {"loss_noisy"}
    spiky = make_history(loss=lambda s, rng, v: v * (4.0 if rng.random() < 0.06 else 1.0))
    assert _serious(report.analyze(spiky, CONFIG, REFERENCE)) == {"loss_noisy"}


def test_high_clip_rate():
    history = make_history(clip_rate=lambda s, rng, v: 0.9, grad_norm=lambda s, rng, v: 3.0)
    findings = report.analyze(history, CONFIG, REFERENCE)
    assert _serious(findings) == {"high_clip_rate"}
    assert "--max_grad_norm 6" in findings[0].recommendation
    assert _serious(report.analyze(history, {**CONFIG, "max_grad_norm": 0.0}, REFERENCE)) == set()


def test_nonfinite_events_severity():
    isolated = make_history(nonfinite_steps=lambda s, rng, v: 1.0 if s in (3000, 9000, 15000) else 0.0,
                            max_consecutive_nonfinite=lambda s, rng, v: 1.0 if s in (3000, 9000, 15000) else 0.0)
    findings = report.analyze(isolated, CONFIG, REFERENCE)
    assert _serious(findings) == {"nonfinite_events"} and findings[0].severity == "warning"
    streak = [dict(r) for r in isolated]
    streak[50]["nonfinite_steps"] = streak[50]["max_consecutive_nonfinite"] = 4.0
    findings = report.analyze(streak, CONFIG, REFERENCE)
    assert findings[0].code == "nonfinite_events" and findings[0].severity == "critical"
    # fp16: GradScaler skipping a few steps while it finds its scale is normal.
    fp16 = {**CONFIG, "mixed_precision": "fp16"}
    findings = report.analyze(isolated, fp16, REFERENCE)
    assert _serious(findings) == set() and "nonfinite_events" in {f.code for f in findings}
    long_streak = [dict(r) for r in isolated]
    long_streak[50]["nonfinite_steps"] = long_streak[50]["max_consecutive_nonfinite"] = 20.0
    findings = report.analyze(long_streak, fp16, REFERENCE)
    assert findings[0].severity == "critical" and "--mixed_precision bf16" in findings[0].recommendation


IMBALANCED_LOSS = 0.05  # the noisiest bin's loss: ~1500x its optimum and ~3 % of the whole objective


def _imbalanced(step, rng, value):
    return IMBALANCED_LOSS


def test_timestep_imbalance_against_the_bayes_reference():
    history = make_history(**{loss_bin_key(9, NUM_BINS): _imbalanced})
    findings = report.analyze(history, CONFIG, REFERENCE)
    assert _serious(findings) == {"timestep_imbalance"}
    ratio = IMBALANCED_LOSS / REFERENCE[loss_bin_key(9, NUM_BINS)]
    assert "900-999" in findings[0].message and f"{ratio:.1f}x" in findings[0].message
    assert "--snr_gamma" in findings[0].recommendation and "v_prediction" in findings[0].recommendation
    # The same reference rebuilt from a config that records sigma_data.
    from_config = report.analyze(history, {**CONFIG, "sigma_data": SIGMA_DATA})
    assert _serious(from_config) == {"timestep_imbalance"}
    # Without any reference, epsilon bins cannot be judged (their optimum spans decades).
    assert _serious(report.analyze(history, CONFIG)) == set()


def test_timestep_imbalance_low_noise_bins_and_v_prediction_peers():
    low = make_history(**{loss_bin_key(0, NUM_BINS): lambda s, rng, v: REFERENCE["loss_bin/00"] * 3})
    findings = report.analyze(low, {**CONFIG, "snr_gamma": 5.0}, REFERENCE)
    assert "0-99" in findings[0].message and "--snr_gamma 5.0 down-weights" in findings[0].recommendation
    v_reference = _reference("v_prediction")
    v_config = {**CONFIG, "prediction_type": "v_prediction"}
    v_history = make_history(reference=v_reference,
                             **{"loss_bin/05": lambda s, rng, v: v_reference["loss_bin/05"] * 20})
    assert _serious(report.analyze(v_history, v_config)) == {"timestep_imbalance"}
    assert _serious(report.analyze(make_history(reference=v_reference), v_config)) == set()


FLOW_CONFIG = {**CONFIG, "objective": "flow_matching", "flow_shift": 3.0, "weighting_scheme": "logit_normal",
               "logit_mean": 0.0, "logit_std": 1.0, "snr_gamma": 5.0,  # the DDPM default, saved but unused
               "sigma_data": SIGMA_DATA}


def test_a_flow_run_is_reported_in_sigma_against_its_own_optimum_with_flow_flags():
    """A flow-matching run's bins are noise levels sigma (index i: the shifted (i + 1) / T), judged
    against the velocity's Bayes-optimal loss, weighted as its --weighting_scheme weights them (1),
    and the advice names the flow flags: --snr_gamma, refused under flow matching, is never offered."""
    from diffusion_extras.core.objectives import FlowMatching, flow_scheduler

    optimum = FlowMatching(flow_scheduler(1000, shift=3.0)).bayes_optimal_loss(SIGMA_DATA).numpy()
    reference = TimestepDiagnostics(1000, NUM_BINS).reference_bins(optimum)
    noisy = make_history(reference=reference, **{loss_bin_key(9, NUM_BINS): lambda s, rng, v: 3.0})
    [finding] = [f for f in report.analyze(noisy, FLOW_CONFIG) if f.code == "timestep_imbalance"]
    # bin 9: indices 900-999, sigma 3 x 0.901 / (1 + 2 x 0.901) = 0.965 up to 1
    ratio = 3.0 / reference["loss_bin/09"]
    assert "Loss in sigma 0.96-1.00 is" in finding.message and f"{ratio:.1f}x" in finding.message
    assert "larger --flow_shift (now 3;" in finding.recommendation and "--snr_gamma" not in finding.recommendation
    low = make_history(reference=reference, **{loss_bin_key(0, NUM_BINS): lambda s, rng, v: 3.0})
    [finding] = [f for f in report.analyze(low, FLOW_CONFIG) if f.code == "timestep_imbalance"]
    assert "Loss in sigma 0.00-0.25 is" in finding.message and "lower --logit_mean" in finding.recommendation
    [noisy_log] = [f for f in report.analyze(make_history(reference=reference, loss_noise=0.4), FLOW_CONFIG)
                   if f.code == "loss_noisy"]
    assert "--snr_gamma" not in noisy_log.recommendation
    # a DDPM run with the same logs is judged on its own schedule (where these losses are far above
    # its optimum in most bins) and named in timesteps, with its own flags
    [ddpm] = [f for f in report.analyze(noisy, {**FLOW_CONFIG, "objective": "ddpm"}) if f.code == "timestep_imbalance"]
    assert ddpm.message.startswith("Loss in timesteps 200-299, ") and "--snr_gamma" in ddpm.recommendation


def test_ema_not_warmed_up():
    constant = make_history(ema_decay=lambda s, rng, v: 0.9999)  # no warm-up: 10k-step horizon
    findings = report.analyze(constant, CONFIG, REFERENCE)
    assert _serious(findings) == {"ema_not_warmed_up"}
    assert "--ema_max_decay 0.9995" in findings[0].recommendation
    assert findings[0].evidence["early_weight_mass"] == pytest.approx(0.9999 ** 18_000, rel=1e-3)


def test_ema_early_mass_follows_the_warm_up_schedule():
    steps = np.arange(25, 2501, 25, dtype=np.float64)
    decays = np.array([_ema_decay(int(s)) for s in steps])
    exact = np.prod([_ema_decay(k) for k in range(251, 2501)])
    assert report_checks.ema_early_mass(steps, decays, 250, 2500) == pytest.approx(exact, rel=1e-2)


def test_too_few_steps():
    config = {**CONFIG, "max_train_steps": 600, "lr_warmup_steps": 50}
    history = make_history(steps=600, every=20, timescale=100.0, config=config)
    findings = report.analyze(history, config, REFERENCE)
    assert _serious(findings) == {"too_few_steps"}
    assert "--max_train_steps 1200" in findings[0].recommendation
    still_falling = make_history(timescale=8000.0)
    assert _serious(report.analyze(still_falling, CONFIG, REFERENCE)) == {"too_few_steps"}
    # Mid-run (on demand), an unfinished run is information, not a problem.
    partial = make_history(steps=10_000)
    assert _serious(report.analyze(partial, CONFIG, REFERENCE)) == set()


def _write_run(tmp_path, history, config=CONFIG):
    os.makedirs(tmp_path / "logs")
    with open(tmp_path / "logs" / "history.jsonl", "w") as fh:
        fh.writelines(json.dumps(record) + "\n" for record in history)
    with open(tmp_path / "training_config.yaml", "w") as fh:
        yaml.safe_dump(config, fh)


def _strict_json(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    with open(path) as fh:
        return json.load(fh, parse_constant=reject)


def test_written_report_parses_and_holds_every_recommendation(tmp_path):
    history = make_history(clip_rate=lambda s, rng, v: 0.9, ema_decay=lambda s, rng, v: 0.9999,
                           **{loss_bin_key(9, NUM_BINS): _imbalanced})
    history[-1]["loss"] = float("nan")
    _write_run(tmp_path, history)
    json_path, md_path = report.write_report(str(tmp_path), bayes_optimal_bins=REFERENCE)
    data = _strict_json(json_path)
    codes = {f["code"] for f in data["findings"]}
    assert {"loss_diverging", "high_clip_rate", "ema_not_warmed_up", "timestep_imbalance"} <= codes
    assert data["summary"]["steps_run"] == 20_000 and data["thresholds"]["HIGH_CLIP_RATE"] == 0.5
    markdown = open(md_path).read()
    for finding in data["findings"]:
        assert finding["recommendation"] in markdown and finding["code"] in markdown
    assert "| steps run | 20000 |" in markdown


def test_cli_on_output_and_checkpoint_dirs(tmp_path):
    _write_run(tmp_path, make_history(steps=600, every=20, timescale=100.0),
               {**CONFIG, "max_train_steps": 600, "lr_warmup_steps": 50})
    result = run_cli(["-m", "diffusion_extras.report", str(tmp_path)])
    assert result.stdout.startswith("# Training health report") and "too_few_steps" in result.stdout
    assert open(tmp_path / "training_report.md").read() == result.stdout
    os.remove(tmp_path / "training_report.md")
    os.makedirs(tmp_path / "checkpoint-600")
    result = run_cli(["-m", "diffusion_extras.report", str(tmp_path / "checkpoint-600")])
    assert (tmp_path / "training_report.md").is_file()


def test_cli_errors_cleanly(tmp_path):
    for args, expected in (((str(tmp_path / "missing"),), "no such directory"),
                           ((str(tmp_path),), "no logs/history.jsonl")):
        result = run_cli(["-m", "diffusion_extras.report", *args], check=False)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and expected in result.stderr
        assert "Traceback" not in result.stderr
    _write_run(tmp_path, make_history(steps=300))
    with open(tmp_path / "logs" / "history.jsonl", "a") as fh:
        fh.write("{not json\n")
    result = run_cli(["-m", "diffusion_extras.report", str(tmp_path)], check=False)
    assert result.returncode == 2 and "history.jsonl:4:" in result.stderr and "Traceback" not in result.stderr


# The default digits run (min-SNR-5, epsilon, 1200 steps): its bins at step 1200, read off
# docs/snr-loss-per-timestep-epsilon.png, and the digits' sigma_data (per-pixel variance 0.2286).
DIGITS_BINS = [0.16, 0.058, 0.038, 0.028, 0.017, 0.0095, 0.0035, 0.00105, 3.8e-4, 2.5e-4]
DIGITS_CONFIG = {**CONFIG, "snr_gamma": 5.0, "learning_rate": 2e-3, "lr_warmup_steps": 100,
                 "max_train_steps": 1200, "sigma_data": 0.2286 ** 0.5}


def test_noisiest_bins_error_floor_is_info_not_an_imbalance():
    history = make_history(steps=1200, every=25, timescale=100.0, config=DIGITS_CONFIG,
                           **{loss_bin_key(i, NUM_BINS): (lambda s, rng, v, x=x: x) for i, x in enumerate(DIGITS_BINS)})
    findings = report.analyze(history, DIGITS_CONFIG)
    assert "timestep_imbalance" not in _serious(findings)
    floor = [f for f in findings if f.code == "timestep_error_floor"]
    assert len(floor) == 1 and floor[0].severity == "info"
    assert "800-899, 900-999" in floor[0].message and "8.9x" in floor[0].message
    shares = floor[0].evidence["objective_shares"]
    assert all(0 < s < timestep_balance.IMBALANCE_MIN_SHARE for s in shares.values())
    # the same bins 5x higher at the noisy end are a material gap again: a warning
    heavy = [dict(r, **{loss_bin_key(9, NUM_BINS): 0.02}) for r in history]
    flagged = [f for f in report.analyze(heavy, DIGITS_CONFIG) if f.code == "timestep_imbalance"]
    assert flagged and "900-999" in flagged[0].message


def test_five_times_the_optimum_at_the_noisiest_bin_is_below_the_floor():
    """Not worth a warning: 5x a ~3e-5 optimum is 1e-4 of excess, 0.01 % of the loss."""
    history = make_history(**{loss_bin_key(9, NUM_BINS): lambda s, rng, v: REFERENCE[loss_bin_key(9, NUM_BINS)] * 5})
    findings = report.analyze(history, CONFIG, REFERENCE)
    assert _serious(findings) == set() and "timestep_error_floor" in {f.code for f in findings}


def _class_ratios(lagging_mean, noise):
    """loss_class/00..02 overrides: classes 0 and 1 at ~0.95 of the loss all reach at their timesteps,
    class 2 at `lagging_mean`, each window scattered by `noise` (relative)."""
    def scattered(mean):
        return lambda step, rng, value: mean * (1 + noise * rng.normal())
    return {f"loss_class/{c:02d}": scattered(mean) for c, mean in enumerate((0.95, 0.95, lagging_mean))}


def test_a_lagging_class_is_named_in_the_cli_report_and_window_noise_is_not(tmp_path):
    noisy = make_history(**_class_ratios(1.3, noise=3.0))  # as high on average, but within its own scatter
    assert "class_lag" not in _serious(report.analyze(noisy, CONFIG, REFERENCE))
    _write_run(tmp_path, make_history(steps=2000, every=20, **_class_ratios(1.4, noise=0.1)),
               {**CONFIG, "max_train_steps": 2000})
    with open(tmp_path / "model_index.json", "w") as fh:  # the exported pipeline's class names
        json.dump({"id2label": {"0": "cat", "1": "dog", "2": "fox"}}, fh)
    result = run_cli(["-m", "diffusion_extras.report", str(tmp_path)])
    assert "WARNING: class_lag" in result.stdout
    assert re.search(r"Class 2 \(fox\) lags: 1\.[34]\dx the loss all classes reach at the same timesteps",
                     result.stdout)
    lag = next(f for f in _strict_json(tmp_path / "training_report.json")["findings"] if f["code"] == "class_lag")
    assert list(lag["evidence"]["lagging"]) == ["2 (fox)"] and len(lag["evidence"]["class_loss_ratios"]) == 3
