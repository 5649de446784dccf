"""Tests for diffusion_extras/core/phema.py and the `python -m diffusion_extras.posthoc_ema` command line."""
import io
import json
import os
import types

import numpy as np
import pytest
import torch
from helpers import run_cli, tiny_unet

from diffusion_extras.cli import common
from diffusion_extras.core import phema
from diffusion_extras.core.phema import (
    PowerFunctionEMA,
    gamma_to_sigma_rel,
    load_snapshots,
    reconstruct,
    sigma_rel_to_gamma,
    solve_weights,
)
from diffusion_extras.evaluation import metrics

FP16_UNIT_ROUNDOFF = 2.0 ** -11  # fp16 keeps 11 significant bits


def flat(tensors):
    return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])


def random_walk_with_drift(num_steps, seed=0):
    """Parameter trajectory shaped like training: a steady drift plus step noise."""
    generator = torch.Generator().manual_seed(seed)
    parameters = [torch.randn(8, 8, generator=generator), torch.randn(16, generator=generator)]
    drifts = [0.02 * torch.randn(p.shape, generator=generator) for p in parameters]
    for _ in range(num_steps):
        for parameter, drift in zip(parameters, drifts):
            parameter.add_(drift + 0.05 * torch.randn(parameter.shape, generator=generator))
        yield parameters


def test_reconstructs_a_width_that_was_never_tracked(tmp_path):
    num_steps, snapshot_every, mid_step = 400, 20, 200
    initial = next(random_walk_with_drift(1))
    tracked = PowerFunctionEMA(initial, sigma_rels=(0.05, 0.10))
    direct = PowerFunctionEMA(initial, sigma_rels=(0.08, 0.05))  # ground truth, not snapshotted
    in_memory, tracked_at_mid = {}, None
    for step, parameters in enumerate(random_walk_with_drift(num_steps), start=1):
        tracked.update(parameters, step)
        direct.update(parameters, step)
        if step % snapshot_every == 0:
            tracked.save_snapshot(str(tmp_path), step, ["weight", "bias"])
            in_memory[step] = [flat(a) for a in tracked.averages]
        if step == mid_step:
            tracked_at_mid = flat(tracked.averages[1])
    truth, nearest_tracked = flat(direct.averages[0]), flat(direct.averages[1])

    rebuilt = reconstruct(str(tmp_path), 0.08)
    error = (flat([rebuilt["weight"], rebuilt["bias"]]) - truth).norm()
    # Not exact for two reasons: the snapshots are fp16 (relative roundoff <= 2**-11 ~ 4.9e-4 per
    # element, so the error is of that order) and 20 snapshots of two profiles span the 0.08
    # profile only approximately. Measured: 2.1e-4 relative, 0.5% of the 0.05-to-0.08 gap.
    assert error / truth.norm() < 2 * FP16_UNIT_ROUNDOFF
    assert error / (truth - nearest_tracked).norm() < 0.02

    # The same weights applied to the fp32 averages isolate the profile-fit error: with 20
    # snapshots it is far below fp16 roundoff (measured 8.4e-6), so storage dominates above.
    snapshots = load_snapshots(str(tmp_path))
    weights = solve_weights([s.step for s in snapshots], [s.gamma for s in snapshots], 400, 0.08)
    gammas = {g: i for i, g in enumerate(tracked.gammas)}
    fit = sum(w * in_memory[s.step][gammas[s.gamma]] for s, w in zip(snapshots, weights))
    assert (fit - truth).norm() / truth.norm() < 1e-4

    # A stored width at a stored step is that snapshot alone, up to fp16 rounding.
    rebuilt_mid = reconstruct(str(tmp_path), 0.10, step=mid_step)
    rebuilt_mid = flat([rebuilt_mid["weight"], rebuilt_mid["bias"]])
    tolerance = 2 * FP16_UNIT_ROUNDOFF * tracked_at_mid.abs() + 1e-6
    assert torch.all((rebuilt_mid - tracked_at_mid).abs() <= tolerance)


def test_solve_weights_picks_the_matching_snapshot_and_ignores_later_ones():
    steps, gammas = [10, 10, 20, 20, 30, 30], [sigma_rel_to_gamma(s) for s in (.05, .1) * 3]
    weights = solve_weights(steps, gammas, 20, 0.10)
    assert weights.dtype == np.float64
    np.testing.assert_allclose(weights, [0, 0, 0, 1, 0, 0], atol=1e-8)
    weights = solve_weights(steps, gammas, 20, 0.07)
    assert weights[4:].tolist() == [0, 0] and weights.sum() == pytest.approx(1, abs=1e-12)
    with pytest.raises(ValueError, match="step 25 has no snapshot"):
        solve_weights(steps, gammas, 25, 0.07)


def test_sigma_rel_gamma_conversion():
    # EDM2 (Sec. 3.1) tracks sigma_rel 0.05 and 0.10, i.e. gamma 16.97 and 6.94.
    assert sigma_rel_to_gamma(0.05) == pytest.approx(16.97, abs=0.005)
    assert sigma_rel_to_gamma(0.10) == pytest.approx(6.94, abs=0.005)
    for sigma_rel in (0.001, 0.03, 0.08, 0.15, 0.25, 0.288):
        assert gamma_to_sigma_rel(sigma_rel_to_gamma(sigma_rel)) == pytest.approx(sigma_rel, 1e-9)
    for bad in (0.0, -0.1, 0.29, 1.0):
        with pytest.raises(ValueError, match="sigma_rel must be in"):
            sigma_rel_to_gamma(bad)


@pytest.mark.parametrize("sigma_rel", [0.05, 0.15])
def test_tracked_average_has_the_requested_relative_width(sigma_rel):
    # Averaging the "parameters" t/T and (t/T)**2 yields the mean and second moment of the
    # averaging profile in units of training time, so its std must be sigma_rel (EDM2 Eq. 123).
    num_steps = 4000
    time = torch.zeros(2)
    ema = PowerFunctionEMA([time], sigma_rels=(sigma_rel,))
    for step in range(1, num_steps + 1):
        fraction = (step - 0.5) / num_steps  # midpoint of the step's interval (step-1, step]
        time.copy_(torch.tensor([fraction, fraction ** 2]))
        ema.update([time], step)
    mean, second_moment = ema.averages[0][0].double()
    assert (second_moment - mean ** 2).sqrt().item() == pytest.approx(sigma_rel, rel=2e-3)


def test_state_dict_round_trip_through_a_checkpoint():
    parameters = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16)]
    first = PowerFunctionEMA(parameters, sigma_rels=(0.05, 0.10))
    for step in range(1, 8):
        first.update([p + step for p in parameters], step)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = PowerFunctionEMA([torch.zeros_like(p) for p in parameters], sigma_rels=(0.05, 0.10))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.step == 7
    for step in range(8, 12):
        first.update([p * step for p in parameters], step)
        resumed.update([p * step for p in parameters], step)
    for a, b in zip(first.averages, resumed.averages):
        assert all(x.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="sigma_rels"):
        PowerFunctionEMA(parameters, sigma_rels=(0.05, 0.2)).load_state_dict(first.state_dict())


def test_snapshot_files_are_fp16_atomic_and_sorted(tmp_path, monkeypatch):
    writes = []

    def recording_save_file(tensors, path, metadata):
        writes.append((path, len(list(tmp_path.glob("phema-*.safetensors")))))
        real_save_file(tensors, path, metadata=metadata)

    real_save_file = phema.save_file
    monkeypatch.setattr(phema, "save_file", recording_save_file)
    late, early = PowerFunctionEMA([torch.ones(3)]), PowerFunctionEMA([torch.ones(3)])
    late.update([torch.full((3,), 2.0)], 120)
    path = late.save_snapshot(str(tmp_path), 120, ["w"])
    early.update([torch.full((3,), 3.0)], 7)
    early.save_snapshot(str(tmp_path), 7, ["w"])
    (tmp_path / ".phema-000000300.safetensors.tmp").write_bytes(b"crashed mid-write")

    assert os.path.basename(path) == "phema-000000120.safetensors"
    # Written under a temporary name, and the final name appeared only after the rename.
    assert [(os.path.basename(p), n) for p, n in writes] == [
        (".phema-000000120.safetensors.tmp", 0), (".phema-000000007.safetensors.tmp", 1)]
    snapshots = load_snapshots(str(tmp_path))
    assert [(s.step, s.sigma_rel) for s in snapshots] == [(7, .05), (7, .10), (120, .05), (120, .10)]
    assert all(s.tensors["w"].dtype == torch.float16 for s in snapshots)
    assert torch.equal(snapshots[1].tensors["w"], torch.full((3,), 3.0, dtype=torch.float16))
    with pytest.raises(ValueError, match="last EMA update step"):
        early.save_snapshot(str(tmp_path), 8, ["w"])


def tiny_training_output(tmp_path):
    from diffusers import DDPMPipeline, DDPMScheduler
    unet = tiny_unet(seed=0)
    names, parameters = zip(*unet.named_parameters())
    ema = PowerFunctionEMA(parameters)
    for step in range(1, 41):
        with torch.no_grad():
            for parameter in parameters:
                parameter.add_(0.01 + 0.02 * torch.randn_like(parameter))
        ema.update(parameters, step)
        if step % 10 == 0:
            ema.save_snapshot(str(tmp_path / "posthoc_ema"), step, list(names))
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=50)).save_pretrained(
        tmp_path)
    return tmp_path


def assert_exported_unet_equals(export_dir, state):
    from diffusers import DDPMPipeline
    unet = DDPMPipeline.from_pretrained(export_dir).unet
    for name, parameter in unet.named_parameters():
        assert torch.equal(parameter, state[name]), name


def test_cli_exports_the_requested_width(tmp_path):
    output = tiny_training_output(tmp_path)
    run_cli(["-m", "diffusion_extras.posthoc_ema", output, "--sigma_rels", "0.08", "--step", "30"])
    state = reconstruct(str(output / "posthoc_ema"), 0.08, step=30)
    assert_exported_unet_equals(output / "posthoc-ema-best", state)
    summary = json.loads((output / "posthoc-ema-best.json").read_text())
    assert (summary["sigma_rel"], summary["step"], summary["chosen_by"]) == (0.08, 30, "requested")
    from diffusers import UNet2DModel
    trained = UNet2DModel.from_pretrained(output / "unet")
    assert not torch.equal(trained.conv_in.weight, state["conv_in.weight"])


def test_cli_evaluates_each_width_and_exports_the_lowest_fid(tmp_path, monkeypatch):
    output = tiny_training_output(tmp_path)
    # Stand-ins with fixed scores, so the lowest-FID choice is known (0.1, the middle one).
    fids, calls = iter([3.0, 1.5, 2.0]), []
    fake_metrics = types.SimpleNamespace(
        build_feature_extractor=lambda name, weights, device: ("extractor", name),
        evaluate_unet_metrics=lambda unet, scheduler, suites, num_samples, *args, **kwargs:
        calls.append(num_samples) or {"fid": next(fids), "kid": 0.1})
    # the command imports these when it runs
    monkeypatch.setattr(metrics, "build_feature_extractor", fake_metrics.build_feature_extractor)
    monkeypatch.setattr(metrics, "evaluate_unet_metrics", fake_metrics.evaluate_unet_metrics)
    monkeypatch.setattr(common, "load_reference", lambda *args: "reference")
    result = run_cli(["-m", "diffusion_extras.posthoc_ema", output, "--sigma_rels", "0.05,0.1,0.15", "--evaluate",
                      "--num_samples", "16", "--reference", "ref.npz", "--device", "cpu", "--export", tmp_path / "x"])
    assert calls == [16, 16, 16]
    assert_exported_unet_equals(tmp_path / "x", reconstruct(str(output / "posthoc_ema"), 0.1))
    summary = json.loads((tmp_path / "x.json").read_text())
    assert summary["sigma_rel"] == 0.1 and [r["fid"] for r in summary["scores"]] == [3, 1.5, 2]
    assert "1.5000" in result.stdout


@pytest.mark.parametrize("argv,message", [
    (["--sigma_rels", "0.5"], "sigma_rel must be in"),
    (["--sigma_rels", "0.05,0.1"], "without --evaluate pass exactly one"),
    (["--sigma_rels", "0.1", "--step", "25"], "step 25 has no snapshot"),
])
def test_cli_rejects_bad_input_with_one_line(tmp_path, argv, message):
    output = tiny_training_output(tmp_path)
    result = run_cli(["-m", "diffusion_extras.posthoc_ema", output, *argv], check=False)
    error = result.stderr
    assert result.returncode == 2 and error.startswith("error: ") and message in error and error.count("\n") == 1


def test_command_line_reports_missing_snapshots(tmp_path):
    """`python -m diffusion_extras.posthoc_ema` through its main() in this process (the module's
    entry, a process, is test_first_contact's): exit code 2 and one error line."""
    from diffusers import DDPMPipeline, DDPMScheduler
    DDPMPipeline(unet=tiny_unet(), scheduler=DDPMScheduler()).save_pretrained(tmp_path)
    os.makedirs(tmp_path / "posthoc_ema")
    result = run_cli(["-m", "diffusion_extras.posthoc_ema", str(tmp_path), "--sigma_rels", "0.1"], check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: no phema-") and "Traceback" not in result.stderr


def test_cli_scores_widths_with_the_real_evaluation_module(tmp_path):
    pytest.importorskip("diffusion_extras.evaluation.metrics")
    from PIL import Image
    output = tiny_training_output(tmp_path / "run")
    generator = np.random.default_rng(0)
    os.makedirs(tmp_path / "reference")
    for index in range(24):
        pixels = generator.integers(0, 256, size=(8, 8), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "reference" / f"{index}.png")
    run_cli(["-m", "diffusion_extras.posthoc_ema", output, "--sigma_rels", "0.05,0.15", "--evaluate",
             "--num_samples", "24", "--num_inference_steps", "4", "--feature_extractor", "tiny", "--device", "cpu",
             "--reference", tmp_path / "reference"])
    summary = json.loads((output / "posthoc-ema-best.json").read_text())
    scores = {row["sigma_rel"]: row["fid"] for row in summary["scores"]}
    assert summary["sigma_rel"] == min(scores, key=scores.get) and len(set(scores.values())) == 2
    state = reconstruct(str(output / "posthoc_ema"), summary["sigma_rel"])
    assert_exported_unet_equals(output / "posthoc-ema-best", state)


def test_a_skipped_step_leaves_the_profiles_untouched():
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 2))]
    ema = PowerFunctionEMA(params)
    ema.update(params, 1, finite=torch.tensor(True))
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    before = [[a.clone() for a in averages] for averages in ema.averages]
    ema.update(params, 2, finite=torch.tensor(False))
    assert ema.step == 2
    assert all(torch.equal(a, b) for old, new in zip(before, ema.averages) for a, b in zip(old, new))
    ema.update(params, 3, finite=torch.tensor(True))
    assert not torch.equal(ema.averages[0][0], before[0][0])
