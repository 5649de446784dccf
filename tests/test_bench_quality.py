"""bench/quality.py end to end on the tiny recipe: a step budget and a time budget each give a
complete report with the classifier FID and the real-data floor; a class-conditional run is scored
per guidance scale through its pipeline. No figure of a trained run is asserted beyond sanity:
they are measurements."""
import json
import math
import os

import numpy as np
import pytest
from helpers import TINY_RECIPE, load_bench_module, run_main, tiny_dit_recipe
from PIL import Image
from processes import run_command


def run_quality(*args):
    return run_command([os.path.join("bench", "quality.py"), *args], timeout=600)


def test_step_budget_reports_classifier_fid_and_the_real_data_floor(tmp_path, tiny_recipe):
    """On a DiT (the tiny one): the bench samples the export's own model, transformer or UNet."""
    out = tmp_path / "quality"
    result = run_quality("--max_train_steps", "3", "--num_samples", "24",
                         "--config", tiny_recipe(**tiny_dit_recipe(tmp_path)),
                         "--samplers", "ddim:3,ddpm:2", "--out", str(out), "--", "--learning_rate", "2e-3")
    report = json.loads((out / "results.json").read_text())
    assert report["steps"] == 3 and report["extra_flags"] == ["--learning_rate", "2e-3"]
    assert all(math.isfinite(report[k]) and report[k] > 0 for k in ("fid_classifier", "floor", "train_seconds"))
    samplers = report["samplers"]  # each sampler scored, the first one's at the top level too
    assert list(samplers) == ["ddim:3", "ddpm:2"] and samplers["ddim:3"]["fid_classifier"] == report["fid_classifier"]
    assert samplers["ddpm:2"]["fid_classifier"] != report["fid_classifier"]
    assert samplers["ddpm:2"]["fid_ratio"] == samplers["ddpm:2"]["fid_classifier"] / report["floor"]
    assert report["held_out_images"] == 13  # round(0.2 x 64): the run's own held-out split
    assert (out / "run-3" / "transformer" / "config.json").is_file()
    history = [json.loads(line) for line in open(out / "run-3" / "logs" / "history.jsonl")]
    assert any("validation/raw_loss" in row for row in history)  # trained with the split held out
    assert "real-data floor" in result.stdout


def test_time_budget_calibrates_then_trains_the_steps_that_fit(tmp_path, tiny_recipe):
    out = tmp_path / "quality"
    budget_seconds = 20  # start-up (~2 s forked) included: the training after it fills the rest
    run_quality("--time_budget", budget_seconds, "--calibration_steps", "4", "--num_samples", "16",
                "--config", tiny_recipe(max_train_samples=32), "--out", str(out))
    report = json.loads((out / "results.json").read_text())
    budget = report["time_budget"]
    expected = int((budget_seconds - budget["startup_seconds"]) / budget["seconds_per_step"])
    assert report["steps"] == budget["steps"] == max(1, expected) and np.isfinite(report["fid_classifier"])
    assert (out / f"run-{report['steps']}" / "model_index.json").is_file()


def test_a_latent_run_is_scored_on_decoded_samples_beside_its_vaes_reconstruction_floor(tmp_path, tiny_recipe):
    """The samples are decoded by the export's VAE (grayscale digits-sized images the classifier
    reads), and vae_floor is the classifier FID of the floor's real digits after the VAE."""
    from helpers import LATENT_MODEL, save_tiny_vae
    vae = save_tiny_vae(tmp_path / "vae", in_channels=1, out_channels=1)
    out = tmp_path / "quality"
    result = run_quality("--max_train_steps", "2", "--num_samples", "16",
                         "--config", tiny_recipe(model=LATENT_MODEL), "--out", str(out),
                         "--", "--pretrained_vae_model_name_or_path", vae)
    report = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(report[k]) and report[k] > 0 for k in ("fid_classifier", "floor", "vae_floor"))
    assert report["vae_floor"] != report["floor"]  # an untrained VAE's reconstructions are not the real digits
    assert "the VAE's reconstructions" in result.stdout
    with Image.open(out / "run-2" / "quality_samples_grid.png") as grid:  # 16 decoded 8 px images, not 4 px latents
        assert grid.size == (2 + 4 * (8 + 2),) * 2 and grid.mode == "L"


def test_conditional_accuracy_is_scored_against_the_requested_labels():
    """A sampler that returns a real digit of the requested class (one the classifier gets right)
    scores 1 per class; one that returns the next class scores 0: accuracy compares against the
    labels asked for, per guidance scale, and the FID ratio is the FID over the floor."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    quality = load_bench_module("quality")
    digits = load_digits()
    images = (digits.images / 16 * 255).round().astype(np.uint8)[..., None]  # 8x8: classifier_input keeps them
    classifier = LogisticRegression(max_iter=2000).fit(quality.classifier_input(images), digits.target)
    scorer = quality.DigitScorer(classifier, images[:300], digits.target[:300], floor=0.5)
    right = scorer.predict(images) == digits.target
    example = {k: images[np.flatnonzero(right & (digits.target == k))[0]] for k in range(10)}

    def sample(class_labels, guidance_scale):  # right at guidance 4, one class off below
        shift = 0 if guidance_scale == 4 else 1
        return np.stack([example[(k + shift) % 10] for k in class_labels])

    report = quality.evaluate_conditional(sample, 10, scorer, 25, [1.0, 4.0])
    assert report["samples_per_class"] == 2 and report["best_guidance"] == "4.0"
    assert report["guidance"]["4.0"]["accuracy"] == 1 and report["guidance"]["4.0"]["per_class_accuracy"] == [1] * 10
    assert report["guidance"]["1.0"]["accuracy"] == 0 and report["guidance"]["1.0"]["per_class_accuracy"] == [0] * 10
    for row in report["guidance"].values():
        assert row["fid_ratio"] == pytest.approx(row["fid_classifier"] / 0.5)
    assert report["real_held_out_accuracy"] == pytest.approx(right[:300].mean())
    assert "| 4.0 | 1.000 |" in quality.conditional_table(report, 0.5)


@pytest.mark.parametrize("backbone", ["unet", "dit"])
def test_a_class_conditional_folder_is_scored_per_guidance_through_its_pipeline(tmp_path, tiny_recipe, backbone):
    """The whole command on an exported (untrained, tiny) class-conditional pipeline, a UNet's
    ClassConditionalPipeline or a DiT's DiTClassPipeline: a folder that holds a pipeline is not
    trained again, so no training process is paid for here (the conditional training itself is
    tested in test_class_conditional.py and test_dit.py)."""
    import torch
    from diffusers import DDPMScheduler, DiTTransformer2DModel, UNet2DModel
    from helpers import TINY_DIT

    from diffusion_extras.training.models import export_pipeline
    quality = load_bench_module("quality")
    out = tmp_path / "quality"
    torch.manual_seed(0)
    model = (UNet2DModel(sample_size=8, num_class_embeds=11, **TINY_RECIPE["model"]) if backbone == "unet" else
             DiTTransformer2DModel(in_channels=1, sample_size=8, num_embeds_ada_norm=10, **TINY_DIT))
    os.makedirs(out / "run-2")
    export_pipeline(model, DDPMScheduler(), str(out / "run-2"), [str(k) for k in range(10)], condition_dropout=0.1)
    result = run_main(quality.main, ["--max_train_steps", "2", "--num_samples", "10", "--guidance_scales", "1,3",
                                     "--config", tiny_recipe(class_conditional=True), "--out", out])
    report = json.loads((out / "results.json").read_text())
    conditional = report["class_conditional"]
    assert set(conditional["guidance"]) == {"1.0", "3.0"} and conditional["samples_per_class"] == 1
    for row in conditional["guidance"].values():
        assert 0 <= row["accuracy"] <= 1 and len(row["per_class_accuracy"]) == 10
        assert math.isfinite(row["fid_classifier"]) and row["fid_ratio"] == pytest.approx(
            row["fid_classifier"] / report["floor"])
    assert report["held_out_images"] == 13 and len(conditional["real_held_out_per_class_accuracy"]) == 10
    assert (out / "run-2" / "quality_samples_guidance_3.0.png").is_file()
    assert "| guidance | class accuracy |" in result.stdout
