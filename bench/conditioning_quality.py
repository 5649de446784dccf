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

    from diffusion_extras.cli.common import list_images, load_image, load_pipeline
    from diffusion_extras.evaluation import conditioned
    from diffusion_extras.evaluation.pipeline_image_conditioned import back_project, degrade
    from diffusion_extras.evaluation.sampling import make_scheduler

    pipe = load_pipeline(pipeline)
    pipe.scheduler = make_scheduler(scheduler, pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    tiles = np.stack([load_image(path, PATCH, 3) for path in list_images(reference)])
    low = (degrade(torch.from_numpy(tiles).permute(0, 3, 1, 2).float() / 127.5 - 1, FACTOR) + 1) / 2
    draws = [np.concatenate([conditioned.sample_conditioned(pipe, {"image": low[first:first + 64]},
                                                            range(first, min(first + 64, len(tiles))), steps, seed, 1.0)
                             for first in range(0, len(tiles), 64)]) for seed in range(samples)]
    mean = np.mean(np.stack(draws).astype(np.float64), axis=0)
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


def paired_gain(images: np.ndarray, tiles: np.ndarray, bicubic: np.ndarray, prefix: str) -> dict:
    """PSNR and SSIM of uint8 `images` against `tiles`, and their PSNR's gain over `bicubic`'s tile
    by tile: mean, standard error and the tiles closer (tiles either reproduces exactly left out)."""
    from diffusion_extras.evaluation import conditioned

    gain = conditioned.psnr(images, tiles) - conditioned.psnr(bicubic, tiles)
    gain = gain[np.isfinite(gain)]
    return {**conditioned.closeness(images, tiles, prefix=prefix), f"{prefix}minus_bicubic_psnr": float(gain.mean()),
            f"{prefix}minus_bicubic_psnr_standard_error": float(gain.std(ddof=1) / np.sqrt(len(gain))),
            f"{prefix}tiles_closer_than_bicubic": f"{int((gain > 0).sum())} of {len(gain)}"}


def super_resolution(args, out: str) -> dict:
    import yaml

    training, held_out = photo_patches(out, args.patches, args.dihedral)
    recipe = os.path.join(out, "sr-recipe.yaml")
    with open(recipe, "w") as fh:
        yaml.safe_dump({"resolution": PATCH, "model": SR_MODEL, "train_batch_size": 32, "save_images_steps":
                        args.max_train_steps, "checkpointing_steps": args.max_train_steps}, fh)
    run = os.path.join(out, f"sr-{args.max_train_steps}")
    seconds = train(run, ["--config", recipe, "--dataset_name", training, "--conditioning", "super_resolution",
                          "--sr_factor", str(FACTOR), "--max_train_steps", str(args.max_train_steps), *args.extra])
    sampler = ["--scheduler", args.scheduler, "--num_inference_steps", str(args.num_inference_steps)]
    scoring = [*sampler, "--feature_extractor", "tiny", "--eval_metrics", "fid", "--batch_size", "64"]
    report = evaluate(run, held_out, scoring)
    report.update(posterior_mean_psnr(run, held_out, args.samples_per_image, args.num_inference_steps, args.scheduler,
                                      args.back_projection_steps))
    seen = evaluate(run, training_band_tiles(out), scoring)
    report.update(training_band_psnr=seen["psnr"], training_band_bicubic_psnr=seen["bicubic_psnr"])
    return {"train_seconds": seconds, "training_patches": args.patches, "dihedral": args.dihedral, **report}


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
    parser.add_argument("--task", choices=("super_resolution", "inpainting"), required=True)
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
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "conditioning"))
    args = parser.parse_args(argv[:split])
    args.extra = argv[split + 1:]  # flags after -- go to both trainings
    os.makedirs(args.out, exist_ok=True)
    result = {"task": args.task, "max_train_steps": args.max_train_steps, "extra_flags": args.extra,
              **(super_resolution if args.task == "super_resolution" else inpainting)(args, args.out)}
    with open(os.path.join(args.out, f"results-{args.task}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
