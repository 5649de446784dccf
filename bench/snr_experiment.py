#!/usr/bin/env python
"""Min-SNR-5 against no weighting, per prediction type, on the digits recipe with equal steps.

    python bench/snr_experiment.py --steps 800 --out bench/results/snr

Trains 6 runs (epsilon, v_prediction, sample) x (no weighting, --snr_gamma 5) with the default
recipe otherwise, then scores 256 EMA samples (DDIM 50) of each with a digit classifier trained on
the real 8x8 digits (logistic regression on the samples shrunk to 8x8):
  confident: share of samples the classifier assigns a class with p > 0.9 (recognisable digits)
  coverage:  entropy of the predicted-class histogram / log(10) (1 = all ten digits equally often)
and FID with the fixed random `tiny` features against 1,000 training images (relative only).
Writes a JSON and a markdown table; the grids and per-timestep plots stay in each run folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from diffusion_extras.evaluation.digits import classifier_input  # the package's digit features

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def digit_classifier():
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    digits = load_digits()
    features = digits.images.reshape(len(digits.images), -1) / 16.0
    return LogisticRegression(max_iter=2000).fit(features, digits.target)


def score_digits(classifier, images: np.ndarray) -> dict:
    probabilities = classifier.predict_proba(classifier_input(images))
    histogram = np.bincount(probabilities.argmax(1), minlength=10) / len(images)
    entropy = -(histogram[histogram > 0] * np.log(histogram[histogram > 0])).sum()
    return {"confident": float((probabilities.max(1) > 0.9).mean()), "coverage": float(entropy / np.log(10))}


def train_command(out: str, prediction_type: str, snr_gamma: float | None, steps: int) -> list[str]:
    flags = ["--output_dir", out, "--max_train_steps", str(steps), "--prediction_type", prediction_type,
             "--save_images_steps", str(steps), "--checkpointing_steps", str(10 * steps), "--logger", "none"]
    flags += ["--snr_gamma", str(snr_gamma or 0)]  # 0: unweighted
    return [sys.executable, os.path.join(ROOT, "train_ddpm.py"), *flags]


def train_all(jobs: list[tuple[str, list[str]]], parallel: int) -> None:
    """Runs not trained yet, `parallel` at a time with one thread each (2 threads on a shared
    2-core machine stall)."""
    pending = [(out, command) for out, command in jobs if not os.path.isfile(os.path.join(out, "model_index.json"))]
    threads = "1" if parallel > 1 else os.environ.get("OMP_NUM_THREADS", "")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads}
    running = []
    while pending or running:
        while pending and len(running) < parallel:
            out, command = pending.pop(0)
            os.makedirs(out, exist_ok=True)
            log = open(os.path.join(out + ".log"), "w")
            running.append((subprocess.Popen(command, env=env, stdout=log, stderr=log), out))
        process, out = running.pop(0)
        if process.wait() != 0:
            raise SystemExit(f"training {out} failed; see {out}.log")


def evaluate(out: str, classifier, reference, extractor) -> dict:
    from diffusers import DDPMPipeline

    from diffusion_extras.evaluation import metrics as evaluation
    from diffusion_extras.evaluation import sampling
    pipeline = DDPMPipeline.from_pretrained(out)
    scheduler = sampling.make_scheduler("ddim", pipeline.scheduler.config)
    images = sampling.generate(pipeline.unet, scheduler, 256, 50, seed=1, batch_size=128)
    sampling.image_grid(images[:64]).save(os.path.join(out, "samples_256_grid.png"))
    features = extractor(images)
    mu, sigma = evaluation.feature_statistics(features)
    fid = evaluation.frechet_distance(mu, sigma, reference.mu, reference.sigma)
    history = [json.loads(line) for line in open(os.path.join(out, "logs", "history.jsonl"))]
    return {**score_digits(classifier, images), "fid_tiny": fid, "final_loss": history[-1]["loss"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "snr"))
    parser.add_argument("--parallel", type=int, default=2, help="trainings at once (one thread each when > 1)")
    args = parser.parse_args(argv)
    from diffusion_extras.data import decode_cache
    from diffusion_extras.data import images as data
    from diffusion_extras.evaluation import metrics as evaluation
    from diffusion_extras.training.config import TrainConfig

    classifier = digit_classifier()
    extractor = evaluation.build_feature_extractor("tiny")
    config = TrainConfig()
    dataset = data.load_image_dataset(config)
    images = decode_cache.decode_dataset(dataset, "image", config.resolution, True, 1).as_array()
    reference = evaluation.reference_statistics(images[:1000], extractor)
    results = {"steps": args.steps, "real_digits": score_digits(classifier, images[:256]), "runs": {}}
    runs = {f"{p}-{'snr5' if g else 'plain'}": (p, g)
            for p in ("epsilon", "v_prediction", "sample") for g in (None, 5.0)}
    train_all([(os.path.join(args.out, name), train_command(os.path.join(args.out, name), p, g, args.steps))
               for name, (p, g) in runs.items()], args.parallel)
    for name in runs:
        results["runs"][name] = evaluate(os.path.join(args.out, name), classifier, reference, extractor)
        print(name, results["runs"][name], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    lines = ["| run | confident (p>0.9) | class coverage | FID (tiny features) | final loss |", "|---|---|---|---|---|"]
    real = results["real_digits"]
    lines.append(f"| real digits | {real['confident']:.2f} | {real['coverage']:.3f} | - | - |")
    for name, r in results["runs"].items():
        lines.append(f"| {name} | {r['confident']:.2f} | {r['coverage']:.3f} | {r['fid_tiny']:.3f} "
                     f"| {r['final_loss']:.4f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
