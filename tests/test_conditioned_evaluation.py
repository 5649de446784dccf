"""Sampling and scoring image-conditioned models (evaluation/conditioned.py, evaluation/digits.py):
PSNR and SSIM, the digit classifier that judges digits it never saw, the sample and evaluate
commands on condition folders, and the scores at --eval_steps."""
import json

import numpy as np
import pytest
import torch
from helpers import read_history, run_cli, run_training, save_tiny_pipeline, tiny_unet
from PIL import Image

from diffusion_extras.evaluation import conditioned, digits
from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline, condition_channels


def save_pipeline(folder, kind: str, sr_factor: int = 2, sample_size: int = 8, **recorded) -> str:
    """A tiny ImageConditionedPipeline (random weights, the trainer's scheduler) saved as the trainer
    exports; `recorded`: what the export records of training (conditioning_dropout_prob, max_noise_level)."""
    from diffusion_extras.training.config import TrainConfig
    from diffusion_extras.training.models import build_noise_scheduler

    unet = tiny_unet(1, sample_size=sample_size, in_channels=1 + condition_channels(kind, 1))
    ImageConditionedPipeline(unet, build_noise_scheduler(TrainConfig(ddpm_num_steps=100)), conditioning=kind,
                             sr_factor=sr_factor, **recorded).save_pretrained(folder)
    return str(folder)


def save_pngs(folder, images: np.ndarray) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(images):
        Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image).save(folder / f"{index:03d}.png")
    return str(folder)


def test_psnr_and_ssim_as_defined():
    """PSNR: an image one level off everywhere scores 10 log10(255^2); SSIM: 1 for an identical image,
    (2ab + c1) / (a^2 + b^2 + c1) for flat images a and b, and the Gaussian-weighted statistics of an
    11 x 11 image (one window) computed directly."""
    rng = np.random.default_rng(0)
    image = rng.integers(1, 255, (2, 11, 11, 3), dtype=np.uint8)
    assert conditioned.psnr(image + 1, image) == pytest.approx([10 * np.log10(255 ** 2)] * 2)
    assert conditioned.ssim(image, image) == pytest.approx([1.0, 1.0])
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    flat = np.full((1, 16, 16, 1), 100, np.uint8), np.full((1, 16, 16, 1), 140, np.uint8)
    assert conditioned.ssim(*flat)[0] == pytest.approx((2 * 100 * 140 + c1) / (100 ** 2 + 140 ** 2 + c1))
    taps = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5 ** 2))
    weights = np.outer(taps, taps) / taps.sum() ** 2

    def window_index(a, b):  # one 11 x 11 window's index from its Gaussian-weighted statistics
        ma, mb = (weights * a).sum(), (weights * b).sum()
        va, vb = (weights * a * a).sum() - ma ** 2, (weights * b * b).sum() - mb ** 2
        cab = (weights * a * b).sum() - ma * mb
        return (2 * ma * mb + c1) * (2 * cab + c2) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2))
    x, y = (rng.integers(0, 256, (11, 11)) for _ in range(2))
    pair = [a.astype(np.uint8)[None, :, :, None] for a in (x, y)]
    assert conditioned.ssim(*pair)[0] == pytest.approx(window_index(x.astype(float), y.astype(float)))
    # several windows of a wider than tall image, two channels: the mean of every window's index
    a, b = (rng.integers(0, 256, (13, 17, 2)) for _ in range(2))
    by_hand = np.mean([window_index(a[i:i + 11, j:j + 11, c].astype(float), b[i:i + 11, j:j + 11, c].astype(float))
                       for i in range(3) for j in range(7) for c in range(2)])
    assert conditioned.ssim(a[None].astype(np.uint8), b[None].astype(np.uint8))[0] == pytest.approx(by_hand)


def test_the_digit_classifier_labels_digits_and_never_saw_them():
    all_digits, labels = digits.preprocessed_digits(16)
    judged = all_digits[::9]
    found, classifier = digits.recognised(judged)
    assert np.array_equal(found, labels[::9])
    assert classifier.trained_on == len(all_digits) - len(judged)  # every judged digit left out (no duplicates)
    assert classifier.accuracy(judged, found) > 0.9  # held out, still recognised
    assert digits.recognised(np.full((3, 16, 16, 1), 7, np.uint8)) is None
    assert digits.recognised(np.concatenate([judged[:2], np.full((1, 16, 16, 1), 7, np.uint8)])) is None


@pytest.mark.parametrize("flags", [[], ["--timestep_spacing", "trailing", "--back_projection_steps", "3"]])
def test_the_evaluate_command_scores_what_the_sample_command_makes(tmp_path, flags):
    """Super-resolution of 12 references: `evaluate` degrades each as training does, samples it and
    scores it; `sample` of those low-resolution images saved as PNG (seed, steps, timestep spacing,
    back-projection alike) makes the same images, whose PSNR against the references is evaluate's;
    the bicubic baseline is scored too (back-projected alike when the samples are); the report
    names the spacing the sampler used."""
    from diffusion_extras.evaluation.pipeline_image_conditioned import degrade

    pipeline = save_pipeline(tmp_path / "sr", "super_resolution")
    references = np.random.default_rng(1).integers(0, 256, (12, 8, 8, 1), dtype=np.uint8)
    low = degrade(torch.from_numpy(references).permute(0, 3, 1, 2).float() / 127.5 - 1, 2)
    low = ((low + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    common = ["--num_inference_steps", 3, "--seed", 4, "--batch_size", 5, "--device", "cpu", *flags]
    reference = save_pngs(tmp_path / "ref", references)
    result = run_cli(["-m", "diffusion_extras.evaluate", pipeline, "--reference", reference, "--feature_extractor",
                      "tiny", "--output", tmp_path / "report.json", *common])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_samples"] == 12 and report["conditioning"] == "super_resolution"
    assert report["timestep_spacing"] == ("trailing" if flags else "leading")
    assert report["back_projection_steps"] == (3 if flags else 0)
    assert {"fid", "kid", "ssim", "bicubic_psnr", "bicubic_ssim"} <= report.keys() and "digit_accuracy" not in report
    run_cli(["-m", "diffusion_extras.sample", pipeline, "--conditioning_images", save_pngs(tmp_path / "low", low),
             "--output", tmp_path / "out", *common])
    made = np.stack([np.asarray(Image.open(tmp_path / "out" / f"{i:06d}.png"))[:, :, None] for i in range(12)])
    assert made.shape == (12, 8, 8, 1)
    assert report["psnr"] == pytest.approx(conditioned.psnr(made, references).mean())
    bicubic = conditioned.bicubic(references, 2)
    assert report["bicubic_psnr"] == pytest.approx(conditioned.psnr(bicubic, references).mean())
    if flags:
        projected = conditioned.bicubic(references, 2, 3)
        assert report["bicubic_back_projected_psnr"] == pytest.approx(conditioned.psnr(projected, references).mean())
        assert report["bicubic_back_projected_psnr"] != pytest.approx(report["bicubic_psnr"])
    else:
        assert "bicubic_back_projected_psnr" not in report
    assert "fid" in result.stdout


def test_inpainting_from_folders_keeps_the_unmasked_pixels_and_scores_digits(tmp_path):
    """`sample` fills the --masks of the images of --conditioning_images and gives the rest back;
    `evaluate` on held-out-style digits with --mask left scores the digit classifier's accuracy on
    the completions, on the references, and on an unconditional --baseline's completions."""
    pipeline = save_pipeline(tmp_path / "inpainting", "inpainting", sample_size=16)
    images = digits.preprocessed_digits(16)[0][:6]
    masks = np.zeros_like(images)
    masks[:, 4:12, 2:9] = 255
    run_cli(["-m", "diffusion_extras.sample", pipeline, "--conditioning_images", save_pngs(tmp_path / "img", images),
             "--masks", save_pngs(tmp_path / "masks", masks), "--num_inference_steps", 2, "--output",
             tmp_path / "out"])
    filled = np.stack([np.asarray(Image.open(tmp_path / "out" / f"{i:06d}.png"))[:, :, None] for i in range(6)])
    assert np.array_equal(filled[masks == 0], images[masks == 0])
    evaluate = ["-m", "diffusion_extras.evaluate", pipeline, "--reference", tmp_path / "img", "--mask", "left",
                "--eval_metrics", "fid", "--feature_extractor", "tiny", "--num_inference_steps", 2]
    result = run_cli([*evaluate, "--baseline", save_tiny_pipeline(tmp_path / "rgb", channels=3)], check=False)
    assert result.returncode == 2 and "--baseline" in result.stderr and "3 channel(s)" in result.stderr
    run_cli([*evaluate, "--baseline", save_tiny_pipeline(tmp_path / "unconditional"), "--output",
             tmp_path / "report.json"])
    report = json.loads((tmp_path / "report.json").read_text())
    for name in ("digit_accuracy", "reference_digit_accuracy", "baseline_digit_accuracy"):
        assert 0 <= report[name] <= 1, name
    assert report["reference_digit_accuracy"] >= 5 / 6 and np.isfinite(report["baseline_psnr"])


def test_the_commands_read_mask_files_as_the_trainer_does(tmp_path):
    """--masks of 0/1 PNGs (read as 0/255 they filled nothing), of 0/255 ones and of masks twice the
    images' size give the same masks, resized and cropped with their images to evaluate's size as
    training decodes a pair; a label map is refused naming its file."""
    import argparse

    from diffusion_extras.cli.common import condition_masks

    images = np.random.default_rng(0).integers(0, 256, (3, 8, 12, 1), dtype=np.uint8)
    masks = np.zeros_like(images)
    masks[:, 2:6, 3:9] = 1
    save_pngs(tmp_path / "img", images)
    paths = sorted(str(path) for path in (tmp_path / "img").glob("*.png"))
    read = {}
    for name, stored in (("0/1", masks), ("0/255", masks * 255),
                         ("twice", np.kron(masks * 255, np.ones((1, 2, 2, 1), np.uint8)))):
        args = argparse.Namespace(masks=save_pngs(tmp_path / name.replace("/", "-"), stored), mask="random", seed=0)
        read[name] = condition_masks(args, paths, str(tmp_path / "img"), (8, 12))
    expected = torch.from_numpy(masks).permute(0, 3, 1, 2).float()
    assert all(torch.equal(mask, expected) for mask in read.values())
    # evaluate's references are resized and cropped to the model's size: the mask with them, as training decodes a pair
    from diffusion_extras.data.conditioning import StoredCondition, decode_pair

    trained = decode_pair({"path": paths[0], "bytes": None}, {"path": str(tmp_path / "0-1" / "000.png"), "bytes": None},
                          4, True, 1, StoredCondition("mask", mask=True))
    cropped = condition_masks(argparse.Namespace(masks=str(tmp_path / "0-1"), mask="random", seed=0), paths,
                              str(tmp_path / "img"), (4, 4))
    assert cropped.shape == (3, 1, 4, 4) and 0 < cropped.mean() < 1
    assert torch.equal(cropped[0, 0], torch.from_numpy(trained[:, :, 1] > 127).float())
    args = argparse.Namespace(masks=save_pngs(tmp_path / "labels", masks * 2), mask="random", seed=0)
    with pytest.raises(ValueError, match=r"000\.png: its values reach 2 of 255"):
        condition_masks(args, paths, str(tmp_path / "img"), (8, 12))


@pytest.mark.parametrize("flags, message", [
    (["--conditioning_images", ".", "--masks", "."],
     "--masks is for inpainting pipelines; this pipeline's conditioning is super_resolution: drop it"),
    (["--conditioning_images", ".", "--mask", "left"],
     "--mask is for inpainting pipelines; this pipeline's conditioning is super_resolution: drop it"),
    (["--conditioning_images", ".", "--class_labels", "3"],
     "--class_labels: this pipeline (ImageConditionedPipeline) has no classes: drop it"),
    ([], "this pipeline is image-conditioned (super_resolution): give --conditioning_images DIR"),
    (["--conditioning_images", ".", "--guide", "."], "an image-conditioned pipeline guides on its image"),
    (["--conditioning_images", ".", "--back_projection_steps", "3"],
     "--back_projection_steps is for super-resolution pipelines; this pipeline's conditioning is inpainting"),
])
def test_what_the_sample_command_refuses(tmp_path, flags, message):
    kind = "inpainting" if "--back_projection_steps" in flags else "super_resolution"
    pipeline = save_pipeline(tmp_path / kind, kind)
    result = run_cli(["-m", "diffusion_extras.sample", pipeline, "--output", tmp_path / "out", *flags], check=False)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kind, level, message", [
    ("super_resolution", 5, "--noise_level 5: this pipeline was trained without conditioning augmentation "
                            "(--max_noise_level): drop it"),
    ("inpainting", 5, "--noise_level is for super-resolution pipelines; this pipeline's conditioning is inpainting: "
                   "drop it"),
    ("augmented", 101, "--noise_level 101: this pipeline takes levels 0 to 100 (its --max_noise_level)"),
])
def test_noise_level_is_refused_before_loading_where_the_pipeline_takes_no_such_level(tmp_path, kind, level,
                                                                                      message):
    """--noise_level is a super-resolution pipeline's trained with conditioning augmentation, within
    the levels it saw; elsewhere one line from the folder's model_index.json, before the UNet loads."""
    pipeline = (save_pipeline(tmp_path / kind, "super_resolution", max_noise_level=100) if kind == "augmented"
                else save_pipeline(tmp_path / kind, kind))
    (tmp_path / kind / "unet" / "diffusion_pytorch_model.safetensors").unlink()  # never read
    result = run_cli(["-m", "diffusion_extras.sample", pipeline, "--conditioning_images", ".", "--noise_level", level,
                      "--output", tmp_path / "out"], check=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == f"error: {message}"


@pytest.mark.parametrize("command", ["sample", "evaluate"])
def test_both_commands_refuse_back_projection_for_a_pipeline_that_is_not_super_resolution(tmp_path, command):
    """An unconditional pipeline given --back_projection_steps: one line naming the flag, before any sampling."""
    pipeline = save_tiny_pipeline(tmp_path / "p")
    reference = save_pngs(tmp_path / "ref", np.zeros((2, 8, 8, 1), np.uint8))
    flags = ["--reference", reference] if command == "evaluate" else []
    result = run_cli(["-m", f"diffusion_extras.{command}", pipeline, "--back_projection_steps", "2", *flags,
                      "--output", tmp_path / "out"], check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --back_projection_steps is for super-resolution pipelines; "
        "this pipeline's conditioning is none: drop it")


def test_a_hub_id_is_refused_the_flags_that_mean_nothing_for_its_kind_as_a_folder_is(tmp_path, monkeypatch):
    """The kind of a Hub id's pipeline is known only once it is loaded: both commands then check the
    condition flags against it, as they check a local folder's before loading. Each refusal is the
    command's one error line."""
    from hub_server import HubServer, serve_in_process

    reference = save_pngs(tmp_path / "ref", np.zeros((2, 8, 8, 1), np.uint8))
    refused = [
        ("sample", "someone/unconditional", ["--back_projection_steps", "3"],
         "--back_projection_steps is for super-resolution pipelines; this pipeline's conditioning is none: drop it"),
        ("sample", "someone/unconditional", ["--conditioning_images", reference],
         "--conditioning_images is for image-conditioned pipelines"),
        ("evaluate", "someone/unconditional", ["--conditioning_images", reference],
         "--conditioning_images is for image-conditioned pipelines"),
        ("evaluate", "someone/unconditional", ["--back_projection_steps", "3"],
         "--back_projection_steps is for super-resolution pipelines"),
        ("sample", "someone/sr", ["--conditioning_images", reference, "--masks", reference],
         "--masks is for inpainting pipelines; this pipeline's conditioning is super_resolution"),
        ("sample", "someone/sr", [], "this pipeline is image-conditioned (super_resolution): give --conditioning"),
        ("evaluate", "someone/sr", ["--conditioning_images", reference],
         "--conditioning_images: this command makes a super_resolution pipeline's conditions from the --reference"),
        ("evaluate", "someone/sr", ["--baseline", "someone/unconditional"],
         "--baseline is for inpainting pipelines; this pipeline's conditioning is super_resolution"),
        ("evaluate", "someone/inpainting", ["--mask", "left", "--masks", reference],
         "--mask draws masks where no --masks are given: give one of them"),
        ("sample", "someone/sr", ["--conditioning_images", reference, "--noise_level", "20"],
         "--noise_level 20: this pipeline was trained without conditioning augmentation (--max_noise_level)"),
        ("evaluate", "someone/inpainting", ["--noise_level", "20"], "--noise_level is for super-resolution pipelines"),
        ("sample", "someone/sr_undropped", ["--conditioning_images", reference, "--guidance_scale", "3"],
         "guidance_scale=3: this model was trained with --conditioning_dropout_prob 0"),
        ("evaluate", "someone/sr_undropped", ["--guidance_scale", "3"],
         "guidance_scale=3: this model was trained with --conditioning_dropout_prob 0"),
    ]
    with HubServer() as server:
        server.add_repo("someone/unconditional", save_tiny_pipeline(tmp_path / "unconditional"))
        server.add_repo("someone/sr", save_pipeline(tmp_path / "sr", "super_resolution"))
        server.add_repo("someone/inpainting", save_pipeline(tmp_path / "inpainting", "inpainting"))
        server.add_repo("someone/sr_undropped", save_pipeline(tmp_path / "sr_undropped", "super_resolution",
                                                              conditioning_dropout_prob=0.0))
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        for command, repo, flags, message in refused:
            extra = ["--reference", reference, "--feature_extractor", "tiny"] if command == "evaluate" else []
            result = run_cli(["-m", f"diffusion_extras.{command}", repo, *flags, *extra, "--output", tmp_path / "out",
                              "--num_inference_steps", 1, "--device", "cpu"], check=False)
            assert result.returncode == 2, (command, repo, flags, result.stdout[-300:])
            assert message in result.stderr.strip().splitlines()[-1], (command, repo, flags)
        assert not (tmp_path / "out").exists()  # refused before anything was sampled


def test_an_inpainting_run_reports_its_scores_at_eval_steps(tiny_recipe, tmp_path):
    """--eval_steps on an inpainting run on the digits: the held-out digits' conditions sampled and
    scored (PSNR, SSIM, the digit classifier on the completions and on the digits, FID)."""
    run_training(tiny_recipe(validation_split=0.1), tmp_path / "run", "--conditioning", "inpainting",
                 "--max_train_steps", 2, "--eval_steps", 2, "--eval_num_samples", 8, "--feature_extractor", "tiny")
    evaluated = [row for row in read_history(tmp_path / "run") if "eval/psnr" in row]
    assert [row["step"] for row in evaluated] == [2]
    row = evaluated[0]
    for name in ("psnr", "ssim", "digit_accuracy", "reference_digit_accuracy", "fid"):
        assert np.isfinite(row[f"eval/{name}"]), name
    assert row["eval/num_samples"] == 6  # the held-out tenth of 64 digits
