#!/usr/bin/env python
"""Does conditioning on an image work? Two measurements, each trained here (skipped when its
export exists) and scored with `python -m diffusion_extras.evaluate` on images never trained on:

    python bench/conditioning_quality.py --task super_resolution --max_train_steps 3000
    python bench/conditioning_quality.py --task inpainting --max_train_steps 1200

super_resolution: 4x super-resolution of photo patches. scikit-learn's two sample photos
(load_sample_images: china.jpg, flower.jpg, 427 x 640) are cut into 8 bands of columns: random 32 px
crops inside bands 0-2 and 4-6 train, the non-overlapping 32 px tiles of bands 3 and 7 (a quarter of
each photo, across its content) are held out. The model (the digits recipe's UNet shape on 3 + 3
channels) upscales the tiles' 8 px versions (training's degradation); reported: PSNR and SSIM of one
sample per tile against the tile, beside bicubic upsampling's (the condition the model starts from),
and of the mean of --samples_per_image samples (an estimate of the posterior mean, the PSNR-optimal
output), and that mean back-projected onto the input (--back_projection_steps, beside bicubic back-
projected alike); and one sample's PSNR on as many tiles of two trained-on bands, beside bicubic's
there (a model that gains much more over bicubic there than on the held-out tiles has memorised its
crops). FID uses the `tiny` features: relative only (no network for the Inception detector).

inpainting: the digits recipe with --conditioning inpainting (random masks) and --validation_split
0.2 (a seeded fifth never trained on), against the unconditional digits recipe trained alike. The
held-out digits have one half masked (left, then top); reported: the share of completions the digit
classifier (evaluation/digits.py, fitted on the other digits) calls the original's class, beside its
accuracy on the originals (the ceiling), on the known half alone (the masked half left blank: what
the visible half already tells; also read by a classifier fitted on halves), on the unconditional
model's completions (the replacement method) and chance (0.1).

Results go to --out (default bench/results/conditioning/) as results-TASK.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH, FACTOR = 32, 4
BANDS, HELD_OUT_BANDS = 8, (3, 7)  # column bands of each photo; these are never trained on
TRAINING_BANDS_SCORED = (2, 6)  # trained-on bands scored like the held-out ones, to see overfitting
SR_MODEL = dict(layers_per_block=1, block_out_channels=[32, 64, 64], norm_num_groups=8, dropout=0.0,
                down_block_types=["DownBlock2D", "DownBlock2D", "AttnDownBlock2D"],
                up_block_types=["AttnUpBlock2D", "UpBlock2D", "UpBlock2D"], in_channels=3, out_channels=3)


def train(out: str, flags: list[str]) -> float:
    """train_ddpm.py into `out` (skipped when it has an export); the wall time in seconds."""
    if os.path.isfile(os.path.join(out, "model_index.json")):
        return float("nan")
    command = [sys.executable, os.path.join(ROOT, "train_ddpm.py"), "--output_dir", out, "--logger", "none", *flags]
    started = time.perf_counter()
    with open(out.rstrip("/") + ".log", "w") as log:
        if subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=log).returncode:
            raise SystemExit(f"training {out} failed; see {out.rstrip('/')}.log")
    return time.perf_counter() - started


def evaluate(pipeline: str, reference: str, flags: list[str]) -> dict:
    """The evaluate command's report of `pipeline` on the `reference` folder."""
    from diffusion_extras.cli.evaluate import main

    report = os.path.join(os.path.dirname(pipeline.rstrip("/")), f"report-{time.monotonic_ns()}.json")
    if main([pipeline, "--reference", reference, "--output", report, "--device", "cpu", *flags]) != 0:
        raise SystemExit(f"evaluating {pipeline} failed")
    with open(report) as fh:
        return json.load(fh)


def save_pngs(folder: str, images: np.ndarray) -> str:
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    for index, image in enumerate(images):
        array = image.squeeze(-1) if image.shape[-1] == 1 else image
        Image.fromarray(array).save(os.path.join(folder, f"{index:04d}.png"))
    return folder


# ----------------------------------------------------------------------------- super-resolution
def photo_patches(out: str, count: int, dihedral: bool = False, seed: int = 0) -> tuple[str, str]:
    """(a saved dataset of `count` random PATCH crops of the photos' training bands, a folder of
    the held-out bands' tiles as PNGs), written once. `dihedral`: each crop also gets one of the 8
    flips and quarter-turns at random, so two photos give the model more kinds of edge to learn
    from (the held-out tiles stay as they are)."""
    import datasets
    from PIL import Image
    from sklearn.datasets import load_sample_images

    training, held_out = os.path.join(out, "patches"), os.path.join(out, "held_out")
    if os.path.isdir(training) and os.path.isdir(held_out):
        return training, held_out
    rng = np.random.default_rng(seed)
    photos = load_sample_images().images
    band = photos[0].shape[1] // BANDS
    # the runs of training bands between the held-out ones: [(first column, last column + 1), ...]
    spans = [(first * band, last * band) for first, last in zip((0,) + tuple(b + 1 for b in HELD_OUT_BANDS),
                                                                HELD_OUT_BANDS) if last > first]
    crops = []
    for index in range(count):
        photo, (start, stop) = photos[index % len(photos)], spans[rng.integers(len(spans))]
        top, left = rng.integers(0, photo.shape[0] - PATCH + 1), rng.integers(start, stop - PATCH + 1)
        crop = photo[top:top + PATCH, left:left + PATCH]
        if dihedral:
            turn = rng.integers(8)
            crop = np.rot90(crop[:, ::-1] if turn >= 4 else crop, k=turn % 4)
        crops.append(Image.fromarray(np.ascontiguousarray(crop)))
    datasets.Dataset.from_dict({"image": crops}, features=datasets.Features({"image": datasets.Image()})) \
        .save_to_disk(training)
    save_pngs(held_out, band_tiles(photos, HELD_OUT_BANDS))
    return training, held_out


def band_tiles(photos: list[np.ndarray], bands: tuple[int, ...]) -> np.ndarray:
    """The non-overlapping PATCH tiles inside the given column bands of each photo."""
    band = photos[0].shape[1] // BANDS
    return np.stack([photo[top:top + PATCH, left:left + PATCH] for photo in photos for index in bands
                     for top in range(0, photo.shape[0] - PATCH + 1, PATCH)
                     for left in range(index * band, (index + 1) * band - PATCH + 1, PATCH)])


def training_band_tiles(out: str) -> str:
    """A folder of the tiles of bands 2 and 6 (trained on; as many tiles as are held out): the model's
    gain over bicubic there beside its gain on the held-out tiles tells memorising from learning."""
    from sklearn.datasets import load_sample_images

    folder = os.path.join(out, "training_band_tiles")
    if not os.path.isdir(folder):
        save_pngs(folder, band_tiles(load_sample_images().images, TRAINING_BANDS_SCORED))
    return folder


def posterior_mean_psnr(pipeline: str, reference: str, samples: int, steps: int, scheduler: str,
                        back_projection_steps: int = 0) -> dict:
    """PSNR and SSIM of the mean of `samples` samples per tile (seeds 0, 1, ...; `scheduler`), and
    how far its PSNR lies above bicubic's, tile by tile: the mean paired difference, its standard
    error (a difference within about two of them is a tie) and the tiles on which the model is
    closer. Tiles that either reproduces exactly (inf dB) are left out of the pairs. With
    `back_projection_steps` the same again for the mean back-projected onto the input that many
    steps (keys prefixed back_projected_), against bicubic and against bicubic back-projected alike."""
    import torch

    from diffusion_extras.cli.common import list_images, load_image
    from diffusion_extras.evaluation import conditioned
    from diffusion_extras.evaluation.pipeline_image_conditioned import back_project, degrade

    tiles = np.stack([load_image(path, PATCH, 3) for path in list_images(reference)])
    low = (degrade(torch.from_numpy(tiles).permute(0, 3, 1, 2).float() / 127.5 - 1, FACTOR) + 1) / 2
    _, mean = mean_of_samples(sampling_pipeline(pipeline, scheduler), low, samples, steps)
    bicubic = conditioned.bicubic(tiles, FACTOR)
    report = {"samples_per_image": samples, **paired_gain(np.round(mean).astype(np.uint8), tiles, bicubic, "mean_")}
    if back_projection_steps:
        pixels = torch.from_numpy(mean).permute(0, 3, 1, 2).float() / 127.5 - 1
        projected = conditioned.to_uint8((back_project(pixels, low * 2 - 1, FACTOR, back_projection_steps) + 1) / 2)
        baseline = conditioned.bicubic(tiles, FACTOR, back_projection_steps)
        report.update(back_projection_steps=back_projection_steps,
                      **paired_gain(projected, tiles, bicubic, "back_projected_mean_"),
                      **paired_gain(baseline, tiles, bicubic, "back_projected_bicubic_"),
                      **{name.replace("minus_bicubic", "minus_back_projected_bicubic"): value for name, value in
                         paired_gain(projected, tiles, baseline, "back_projected_mean_").items() if "minus" in name})
    return report


def sampling_pipeline(pipeline: str, scheduler: str):
    """The exported pipeline at `pipeline`, sampling with `scheduler` (the evaluate command's choice)."""
    from diffusion_extras.cli.common import load_pipeline
    from diffusion_extras.evaluation.sampling import make_scheduler

    pipe = load_pipeline(pipeline)
    pipe.scheduler = make_scheduler(scheduler, pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def mean_of_samples(pipe, low, samples: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(the first sample, uint8 [N, H, W, C]; the mean of `samples` samples (seeds 0, 1, ...), float64
    in 0..255) of each low-resolution input in `low` [N, C, h, w] in [0, 1], 64 a batch, `steps`
    denoising steps, at the pipeline's default noise_level."""
    from diffusion_extras.evaluation import conditioned

    draws = [np.concatenate([conditioned.sample_conditioned(pipe, {"image": low[first:first + 64]},
                                                            range(first, min(first + 64, len(low))), steps, seed, 1.0)
                             for first in range(0, len(low), 64)]) for seed in range(samples)]
    return draws[0], np.mean(np.stack(draws).astype(np.float64), axis=0)


def paired_gain(images: np.ndarray, tiles: np.ndarray, bicubic: np.ndarray, prefix: str) -> dict:
    """PSNR and SSIM of uint8 `images` against `tiles`, and their PSNR's gain over `bicubic`'s tile
    by tile: mean, standard error and the tiles closer (tiles either reproduces exactly left out)."""
    from diffusion_extras.evaluation import conditioned

    gain = conditioned.psnr(images, tiles) - conditioned.psnr(bicubic, tiles)
    gain = gain[np.isfinite(gain)]
    return {**conditioned.closeness(images, tiles, prefix=prefix), f"{prefix}minus_bicubic_psnr": float(gain.mean()),
            f"{prefix}minus_bicubic_psnr_standard_error": float(gain.std(ddof=1) / np.sqrt(len(gain))),
            f"{prefix}tiles_closer_than_bicubic": f"{int((gain > 0).sum())} of {len(gain)}"}


def super_resolution_flags(args, out: str, training: str) -> list[str]:
    """The trainer's flags of a super-resolution run on the `training` crops (its recipe written to `out`)."""
    import yaml

    recipe = os.path.join(out, "sr-recipe.yaml")
    with open(recipe, "w") as fh:
        yaml.safe_dump({"resolution": PATCH, "model": SR_MODEL, "train_batch_size": 32, "save_images_steps":
                        args.max_train_steps, "checkpointing_steps": args.max_train_steps}, fh)
    return ["--config", recipe, "--dataset_name", training, "--conditioning", "super_resolution",
            "--sr_factor", str(FACTOR), "--max_train_steps", str(args.max_train_steps), *args.extra]


def super_resolution(args, out: str) -> dict:
    training, held_out = photo_patches(out, args.patches, args.dihedral)
    run = os.path.join(out, f"sr-{args.max_train_steps}")
    seconds = train(run, super_resolution_flags(args, out, training))
    sampler = ["--scheduler", args.scheduler, "--num_inference_steps", str(args.num_inference_steps)]
    scoring = [*sampler, "--feature_extractor", "tiny", "--eval_metrics", "fid", "--batch_size", "64"]
    report = evaluate(run, held_out, scoring)
    report.update(posterior_mean_psnr(run, held_out, args.samples_per_image, args.num_inference_steps, args.scheduler,
                                      args.back_projection_steps))
    seen = evaluate(run, training_band_tiles(out), scoring)
    report.update(training_band_psnr=seen["psnr"], training_band_bicubic_psnr=seen["bicubic_psnr"])
    return {"train_seconds": seconds, "training_patches": args.patches, "dihedral": args.dihedral, **report}


# ----------------------------------------------------------------------------- regression baseline
def train_regression(run: str, training: str, steps: int, batch_size: int = 32, seed: int = 0) -> float:
    """The regression baseline, saved as `run`/unet (skipped when there): SR_MODEL's UNet with the
    condition alone as input (the bicubic upsampling of each crop degraded as training degrades it)
    trained by MSE to give the crop itself, at timestep 0: the posterior mean that a mean of samples
    approaches, learned directly (SR3's and Saharia et al.'s regression baseline). Optimised as the
    trainer's recipe is: AdamW at 2e-3, 100 warm-up steps then a cosine decay, gradients clipped at 1,
    the EMA of the weights (decay capped at 0.999, warm-up power 3/4) saved; `batch_size` crops a
    step in a seeded order, one epoch after another. By hand: the trainer trains diffusion models
    only. Returns the wall time in seconds."""
    import datasets
    import torch
    from diffusers import UNet2DModel

    from diffusion_extras.core.ema import ExponentialMovingAverage
    from diffusion_extras.core.optimization import make_optimizer, training_lr_schedule
    from diffusion_extras.evaluation.pipeline_image_conditioned import degrade, upsample

    if os.path.isdir(os.path.join(run, "unet")):
        return float("nan")
    started = time.perf_counter()
    crops = np.stack([np.asarray(image.convert("RGB")) for image in datasets.load_from_disk(training)["image"]])
    pixels = torch.from_numpy(crops).permute(0, 3, 1, 2).float() / 127.5 - 1
    torch.manual_seed(seed)
    unet = UNet2DModel(**SR_MODEL, sample_size=PATCH)
    optimizer = make_optimizer(unet.parameters(), 2e-3)
    schedule = training_lr_schedule(optimizer, "cosine", 100, steps)
    ema = ExponentialMovingAverage(unet.parameters(), max_decay=0.999, inv_gamma=1.0, power=0.75)
    rng, order = np.random.default_rng(seed), np.empty(0, dtype=np.int64)
    for step in range(steps):
        if len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(len(pixels))])
        targets, order = pixels[order[:batch_size]], order[batch_size:]
        condition = upsample(degrade(targets, FACTOR), FACTOR)
        loss = torch.nn.functional.mse_loss(unet(condition, 0).sample, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        ema.step(unet.parameters())
        if step % 50 == 0 or step == steps - 1:
            print(f"regression step {step + 1}/{steps}: loss {loss.item():.5f}", flush=True)
    ema.copy_to(unet.parameters())
    unet.save_pretrained(os.path.join(run, "unet"))
    return time.perf_counter() - started


def regression_output(run: str, low):
    """The regression baseline's output in [-1, 1] [N, C, H, W] for low-resolution inputs in [0, 1]."""
    import torch
    from diffusers import UNet2DModel

    from diffusion_extras.evaluation.pipeline_image_conditioned import upsample

    unet = UNet2DModel.from_pretrained(os.path.join(run, "unet")).eval()
    with torch.no_grad():
        return torch.cat([unet(upsample(low[first:first + 64] * 2 - 1, FACTOR), 0).sample
                          for first in range(0, len(low), 64)]).clamp(-1, 1)


# ----------------------------------------------------------------------------- untrained degradations
JPEG_QUALITY = 75  # Pillow's default
NOISE_SIGMA = 8    # 8-bit levels: sensor noise of a dim photo
DEGRADATIONS = {
    "bicubic": "antialiased bicubic, 8-bit (training's degradation)",
    "box": "Pillow's box filter (the mean of each 4 x 4 block), 8-bit",
    "jpeg": f"training's, then saved as JPEG at quality {JPEG_QUALITY} (Pillow's default; 4:2:0 chroma)",
    "noise": f"training's, plus Gaussian noise of sigma {NOISE_SIGMA} 8-bit levels, rounded to 8 bits",
}


def degraded(tiles: np.ndarray, name: str, seed: int = 0):
    """The low-resolution inputs [N, C, h, w] in [0, 1] (8-bit levels) of uint8 tiles [N, H, W, C]
    made by the degradation `name` (DEGRADATIONS; the noise drawn from `seed`)."""
    import torch
    from PIL import Image

    from diffusion_extras.evaluation.pipeline_image_conditioned import degrade

    if name == "box":
        size = (tiles.shape[2] // FACTOR, tiles.shape[1] // FACTOR)
        low = np.stack([np.asarray(Image.fromarray(tile).resize(size, Image.Resampling.BOX)) for tile in tiles])
    else:
        trained = degrade(torch.from_numpy(tiles).permute(0, 3, 1, 2).float() / 127.5 - 1, FACTOR)
        low = ((trained + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        if name == "jpeg":
            low = np.stack([jpeg(image) for image in low])
        elif name == "noise":
            noise = np.random.default_rng(seed).normal(0, NOISE_SIGMA, low.shape)
            low = np.clip(np.round(low + noise), 0, 255).astype(np.uint8)
        elif name != "bicubic":
            raise ValueError(f"no degradation {name!r} (one of {', '.join(DEGRADATIONS)})")
    return torch.from_numpy(np.ascontiguousarray(low)).permute(0, 3, 1, 2).float() / 255


def jpeg(image: np.ndarray) -> np.ndarray:
    """uint8 [h, w, C] saved as JPEG at JPEG_QUALITY and read back."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=JPEG_QUALITY)
    return np.asarray(Image.open(buffer).convert(Image.fromarray(image).mode))


def degradation_scores(diffusion_runs: dict, regression: str, tiles: np.ndarray, samples: int, steps: int,
                       scheduler: str, back_projection_steps: int) -> dict:
    """For each degradation (DEGRADATIONS) of the held-out `tiles`: bicubic's PSNR and SSIM (of the
    upsampled input, and back-projected onto it), and for each model, the diffusion models of
    `diffusion_runs` ({name: export}; the mean of `samples` samples, and one sample) and the
    `regression` baseline (its output), the same alike with their PSNR's paired gain over bicubic's
    (unprojected: over bicubic; back-projected: over bicubic back-projected alike)."""
    import torch

    from diffusion_extras.evaluation import conditioned
    from diffusion_extras.evaluation.pipeline_image_conditioned import back_project, upsample

    pipes = {name: sampling_pipeline(run, scheduler) for name, run in diffusion_runs.items()}
    unit = (lambda pixels: conditioned.to_uint8((pixels + 1) / 2))  # noqa: E731  [-1, 1] -> uint8 images
    report = {}
    for degradation in DEGRADATIONS:
        low = degraded(tiles, degradation)
        project = (lambda pixels: back_project(pixels, low * 2 - 1, FACTOR, back_projection_steps))  # noqa: B023,E731
        bicubic = upsample(low * 2 - 1, FACTOR)
        baselines = unit(bicubic), unit(project(bicubic))
        rows = {"bicubic": {**conditioned.closeness(baselines[0], tiles),
                            **conditioned.closeness(baselines[1], tiles, prefix="back_projected_")}}
        outputs = {"regression": (regression_output(regression, low), None)}
        for name, pipe in pipes.items():
            first, mean = mean_of_samples(pipe, low, samples, steps)
            outputs[name] = torch.from_numpy(mean).permute(0, 3, 1, 2).float() / 127.5 - 1, first
        for name, (output, first) in outputs.items():
            projected = paired_gain(unit(project(output)), tiles, baselines[1], "back_projected_")
            rows[name] = {**paired_gain(unit(output), tiles, baselines[0], ""),
                          **{key.replace("minus_bicubic", "minus_back_projected_bicubic")
                             .replace("closer_than_bicubic", "closer_than_back_projected_bicubic"): value
                             for key, value in projected.items()}}
            if first is not None:
                rows[name]["one_sample_psnr"] = conditioned.closeness(first, tiles)["psnr"]
        report[degradation] = rows
    return report


def super_resolution_degradations(args, out: str) -> dict:
    """The plain upscaler and one trained with conditioning augmentation (--max_noise_level), equal in
    everything else, and the regression baseline, scored on the held-out tiles degraded as training
    degrades them and by each untrained degradation (DEGRADATIONS)."""
    from diffusion_extras.cli.common import list_images, load_image
    from diffusion_extras.evaluation.pipeline_image_conditioned import DEFAULT_NOISE_LEVEL

    training, held_out = photo_patches(out, args.patches, args.dihedral)
    flags, steps = super_resolution_flags(args, out, training), args.max_train_steps
    runs = {"plain": os.path.join(out, f"sr-{steps}"),
            "augmented": os.path.join(out, f"sr-{steps}-noise{args.max_noise_level}")}
    seconds = {"plain": train(runs["plain"], flags),
               "augmented": train(runs["augmented"], [*flags, "--max_noise_level", str(args.max_noise_level)])}
    regression = os.path.join(out, f"regression-{steps}")
    seconds["regression"] = train_regression(regression, training, steps)
    tiles = np.stack([load_image(path, PATCH, 3) for path in list_images(held_out)])
    return {"train_seconds": seconds, "training_patches": args.patches, "dihedral": args.dihedral,
            "max_noise_level": args.max_noise_level, "noise_level": DEFAULT_NOISE_LEVEL,
            "samples_per_image": args.samples_per_image, "back_projection_steps": args.back_projection_steps,
            "num_samples": len(tiles), "degradations": DEGRADATIONS,
            "scores": degradation_scores(runs, regression, tiles, args.samples_per_image, args.num_inference_steps,
                                         args.scheduler, args.back_projection_steps)}


# ----------------------------------------------------------------------------- inpainting
def held_out_digits(out: str, flags: list[str]) -> str:
    """The digits a --validation_split 0.2 run holds out (its seeded split), as a folder of PNGs."""
    from diffusion_extras.data import batch_order, decode_cache
    from diffusion_extras.data import images as data
    from diffusion_extras.training.config import parse_config

    folder = os.path.join(out, "held_out_digits")
    if not os.path.isdir(folder):
        config = parse_config(flags)
        decoded = decode_cache.decode_dataset(data.load_image_dataset(config), "image", config.resolution, True, 1)
        _, held_out = batch_order.split_held_out(decoded, config.validation_split, config.seed)
        save_pngs(folder, np.stack([held_out.image(i) for i in range(len(held_out))]))
    return folder


def known_half_accuracy(reference: str, side: str) -> dict:
    """What the visible half of each digit of the `reference` folder tells alone, its `side` half (the
    evaluate command's --mask half) left blank at the background's 0: the accuracy of the digit
    classifier that judges the completions (fitted on the other, whole digits), and of one fitted on
    the other digits blanked alike (which learns to read halves)."""
    from diffusion_extras.cli.common import list_images, read_images
    from diffusion_extras.data.conditioning import half_mask
    from diffusion_extras.evaluation.digits import DigitClassifier, preprocessed_digits, recognised

    digits = read_images(list_images(reference), 1)
    labels, classifier = recognised(digits)
    masked = half_mask(*digits.shape[1:3], side)[None, :, :, None]
    blanked = np.where(masked, 0, digits).astype(np.uint8)
    every, every_label = preprocessed_digits(digits.shape[1:3])
    judged = {digit.tobytes() for digit in digits}
    others = np.array([digit.tobytes() not in judged for digit in every])
    refit = DigitClassifier(np.where(masked, 0, every[others]).astype(np.uint8), every_label[others])
    return {"known_half_digit_accuracy": classifier.accuracy(blanked, labels),
            "known_half_refit_digit_accuracy": refit.accuracy(blanked, labels)}


def inpainting(args, out: str) -> dict:
    common = ["--validation_split", "0.2", "--max_train_steps", str(args.max_train_steps),
              "--save_images_steps", str(args.max_train_steps), "--checkpointing_steps", str(args.max_train_steps),
              *args.extra]
    runs = {"inpainting": os.path.join(out, f"inpainting-{args.max_train_steps}"),
            "unconditional": os.path.join(out, f"unconditional-{args.max_train_steps}")}
    seconds = {name: train(run, common + (["--conditioning", "inpainting"] if name == "inpainting" else []))
               for name, run in runs.items()}
    reference = held_out_digits(out, common)
    report = {"train_seconds": seconds, "chance": 0.1}
    for side in ("left", "top"):
        report[side] = evaluate(runs["inpainting"], reference, [
            "--mask", side, "--baseline", runs["unconditional"], "--scheduler", args.scheduler, "--num_inference_steps",
            str(args.num_inference_steps), "--feature_extractor", "tiny", "--eval_metrics", "fid"])
        report[side].update(known_half_accuracy(reference, side))
    return report


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--task", choices=tuple(TASKS), required=True)
    parser.add_argument("--max_train_steps", type=int, required=True)
    parser.add_argument("--scheduler", choices=("ddim", "ddpm", "dpm"), default="ddim",
                        help="the sampler of every sample (the evaluate command's --scheduler; default: ddim)")
    parser.add_argument("--num_inference_steps", type=int, default=50,
                        help="denoising steps of every sample (default: 50)")
    parser.add_argument("--patches", type=int, default=4000, help="super_resolution: training crops")
    parser.add_argument("--dihedral", action="store_true",
                        help="super_resolution: give each training crop one of the 8 flips and quarter-turns")
    parser.add_argument("--samples_per_image", type=int, default=4, help="super_resolution: the mean's samples")
    parser.add_argument("--back_projection_steps", type=int, default=10,
                        help="super_resolution: also score the mean back-projected onto the input this many steps, "
                             "beside bicubic back-projected alike (the commands' flag; 0: not; default: 10)")
    parser.add_argument("--max_noise_level", type=int, default=350,
                        help="super_resolution_degradations: the augmented run's --max_noise_level (default: 350, "
                             "diffusers' x4 upscaler's); it samples at the pipeline's default noise_level")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "conditioning"))
    args = parser.parse_args(argv[:split])
    args.extra = argv[split + 1:]  # flags after -- go to both trainings
    os.makedirs(args.out, exist_ok=True)
    result = {"task": args.task, "max_train_steps": args.max_train_steps, "extra_flags": args.extra,
              **TASKS[args.task](args, args.out)}
    with open(os.path.join(args.out, f"results-{args.task}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))
    return result


TASKS = {"super_resolution": super_resolution, "super_resolution_degradations": super_resolution_degradations,
         "inpainting": inpainting}

if __name__ == "__main__":
    main()
