#!/usr/bin/env python
"""Sample quality of a digits recipe for a step or time budget, against the real-data floor.

    python bench/quality.py --max_train_steps 1200                # the default recipe
    python bench/quality.py --time_budget 300 -- --snr_gamma 0    # 5 minutes; flags after -- go to training

Trains the recipe with --validation_split 0.2 (a seeded fifth of the digits never trained on),
samples --num_samples EMA images (DDIM, 50 steps, seed 1) and scores them with a digit classifier:
logistic regression fitted on the TRAINING split, every image taken through the training
preprocessing and shrunk to 8x8 (snr_experiment.classifier_input). Reported:
  fid_classifier: Frechet distance of the classifier's 10 logits, samples vs the held-out digits;
  floor:          the same distance for real training-split digits vs the held-out digits, i.e. the
                  best a generator can score at this resolution and sample count;
  confident / coverage as in snr_experiment.py.
A recipe change is judged by how far above the floor it ends, or the budget it needs to reach it.
--time_budget first times a short calibration run and trains the steps that fit (the LR schedule
then completes within the budget, as it would for a step budget).
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
sys.path.insert(0, os.path.join(ROOT, "bench"))

from snr_experiment import classifier_input, score_digits  # noqa: E402

VALIDATION_SPLIT = 0.2


def train(out: str, steps: int, recipe: str | None, extra: list[str]) -> float:
    """Trains into `out` (skipped when a pipeline is there); returns the wall time in seconds."""
    if os.path.isfile(os.path.join(out, "model_index.json")):
        return float("nan")
    flags = ["--output_dir", out, "--max_train_steps", str(steps), "--validation_split", str(VALIDATION_SPLIT),
             "--save_images_steps", str(steps), "--checkpointing_steps", str(10 * steps), "--logger", "none"]
    command = [sys.executable, os.path.join(ROOT, "train_ddpm.py"), *(["--config", recipe] if recipe else []),
               *flags, *extra]
    started = time.perf_counter()
    with open(out.rstrip("/") + ".log", "w") as log:
        if subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=log).returncode:
            raise SystemExit(f"training {out} failed; see {out.rstrip('/')}.log")
    return time.perf_counter() - started


def steps_for_budget(out: str, seconds: float, recipe: str | None, extra: list[str], calibration_steps: int) -> dict:
    """Steps that fit in `seconds`, from the median images/s of a short calibration run (its
    start-up is left out of the rate and charged to the budget once)."""
    calibration = os.path.join(out, "calibration")
    wall = train(calibration, calibration_steps, recipe, extra)
    history = [json.loads(line) for line in open(os.path.join(calibration, "logs", "history.jsonl"))]
    rates = [r["images_per_second"] for r in history if "images_per_second" in r][1:]  # the first holds warm-up
    with open(os.path.join(calibration, "training_config.yaml")) as fh:
        import yaml
        batch = yaml.safe_load(fh)["train_batch_size"]
    step_seconds = batch / float(np.median(rates))
    startup = max(0.0, wall - calibration_steps * step_seconds)
    steps = max(1, int((seconds - startup) / step_seconds))
    return {"steps": steps, "seconds_per_step": step_seconds, "startup_seconds": startup}


def real_digits(recipe: str | None, extra: list[str]):
    """(training-split images, their labels, held-out images) exactly as the run split them."""
    from diffusion_extras.data import batch_order, decode_cache
    from diffusion_extras.data import images as data
    from diffusion_extras.training.config import parse_config

    config = parse_config([*(["--config", recipe] if recipe else []), *extra,
                           "--validation_split", str(VALIDATION_SPLIT)])
    if config.dataset_name or config.train_data_dir:
        raise SystemExit("bench/quality.py scores digits: leave out --dataset_name / --train_data_dir")
    dataset = data.load_image_dataset(config)
    images = decode_cache.decode_dataset(dataset, "image", config.resolution, True, 1)
    training, held_out = batch_order.split_held_out(images, config.validation_split, config.seed)
    as_array = lambda part: np.stack([part.image(i) for i in range(len(part))])  # noqa: E731
    labels = np.asarray(dataset["label"])[training.rows]
    return as_array(training), labels, as_array(held_out)


def classifier_fid(classifier, images: np.ndarray, reference: np.ndarray) -> float:
    from diffusion_extras.evaluation import metrics as evaluation
    logits = [classifier.decision_function(classifier_input(part)) for part in (images, reference)]
    (mu1, sigma1), (mu2, sigma2) = (evaluation.feature_statistics(f) for f in logits)
    return evaluation.frechet_distance(mu1, sigma1, mu2, sigma2)


def evaluate(run_dir: str, recipe: str | None, extra: list[str], num_samples: int) -> dict:
    from diffusers import DDPMPipeline
    from sklearn.linear_model import LogisticRegression

    from diffusion_extras.evaluation import sampling
    training, labels, held_out = real_digits(recipe, extra)
    classifier = LogisticRegression(max_iter=2000).fit(classifier_input(training), labels)
    pipeline = DDPMPipeline.from_pretrained(run_dir)
    scheduler = sampling.make_scheduler("ddim", pipeline.scheduler.config)
    samples = sampling.generate(pipeline.unet, scheduler, num_samples, 50, seed=1, batch_size=128)
    sampling.image_grid(samples[:64]).save(os.path.join(run_dir, "quality_samples_grid.png"))
    real = training[np.random.default_rng(1).permutation(len(training))[:num_samples]]
    return {"fid_classifier": classifier_fid(classifier, samples, held_out),
            "floor": classifier_fid(classifier, real, held_out), **score_digits(classifier, samples),
            "real_confident_coverage": score_digits(classifier, held_out), "held_out_images": len(held_out),
            "num_samples": num_samples}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--max_train_steps", type=int, help="step budget")
    budget.add_argument("--time_budget", type=float, help="seconds of training (start-up included)")
    parser.add_argument("--config", default=None, help="YAML recipe (default: the embedded digits recipe)")
    parser.add_argument("--num_samples", type=int, default=1000, help="generated images scored")
    parser.add_argument("--calibration_steps", type=int, default=30, help="steps of the --time_budget timing run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "quality"))
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    os.makedirs(args.out, exist_ok=True)
    result = {"recipe": args.config or "digits (defaults)", "extra_flags": extra}
    steps = args.max_train_steps
    if args.time_budget is not None:
        result["time_budget"] = {"seconds": args.time_budget, **steps_for_budget(
            args.out, args.time_budget, args.config, extra, args.calibration_steps)}
        steps = result["time_budget"]["steps"]
    run_dir = os.path.join(args.out, f"run-{steps}")
    result.update(steps=steps, train_seconds=train(run_dir, steps, args.config, extra))
    result.update(evaluate(run_dir, args.config, extra, args.num_samples))
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))
    print(f"classifier FID {result['fid_classifier']:.3f} after {steps} steps; real-data floor {result['floor']:.3f}")


if __name__ == "__main__":
    main()
