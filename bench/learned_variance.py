#!/usr/bin/env python
"""Fixed against learned variance on the digits: ancestral (DDPM) sampling at several
step counts, scored by bench/quality.py's classifier FID, and bits/dim of the held-out digits.

    python bench/learned_variance.py --max_train_steps 600 --out bench/results/learned_variance

Trains (or reuses) the default digits recipe twice with --validation_split 0.2, once with
--variance_type fixed_small and once with learned_range, everything else equal. For each it
samples --num_samples EMA images with DDPMScheduler at each of --ddpm_steps (the exported
scheduler's own variance: fixed_small, or the learned one) and reports the classifier FID against
the held-out digits beside the floor (quality.py), then the bits/dim of the held-out digits
(evaluation/likelihood.py, --nll_timestep_stride). Writes one JSON per variance type.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

from quality import classifier_fid, real_digits, train  # noqa: E402
from snr_experiment import classifier_input, score_digits  # noqa: E402


def measure(run_dir: str, variance_type: str, ddpm_steps: list[int], num_samples: dict, nll_stride: int) -> dict:
    from diffusers import DDPMPipeline
    from sklearn.linear_model import LogisticRegression

    from diffusion_extras.evaluation import likelihood, sampling

    training, labels, held_out = real_digits(None, ["--variance_type", variance_type])
    classifier = LogisticRegression(max_iter=2000).fit(classifier_input(training), labels)
    pipeline = DDPMPipeline.from_pretrained(run_dir)
    results = {"variance_type": variance_type, "run_dir": run_dir, "held_out_images": len(held_out)}
    if nll_stride:  # 0: no bits/dim
        started = time.perf_counter()
        results["nll"] = likelihood.bits_per_dim(pipeline.unet, pipeline.scheduler, held_out, batch_size=128,
                                                 timestep_stride=nll_stride)
        results["nll"]["seconds"] = time.perf_counter() - started
        print(json.dumps(results["nll"]), flush=True)
    for steps in ddpm_steps:
        count = num_samples.get(steps, num_samples["default"])
        started = time.perf_counter()
        scheduler = sampling.make_scheduler("ddpm", pipeline.scheduler.config)
        samples = sampling.generate(pipeline.unet, scheduler, count, steps, seed=1, batch_size=128)
        sampling.image_grid(samples[:64]).save(os.path.join(run_dir, f"ddpm_{steps}_steps.png"))
        real = training[np.random.default_rng(1).permutation(len(training))[:count]]  # the floor at this count
        results[f"ddpm_{steps}"] = {"fid_classifier": classifier_fid(classifier, samples, held_out),
                                    "floor": classifier_fid(classifier, real, held_out), "num_samples": count,
                                    **score_digits(classifier, samples), "seconds": time.perf_counter() - started}
        print(json.dumps({steps: results[f"ddpm_{steps}"]}), flush=True)
        with open(run_dir.rstrip("/") + ".json", "w") as fh:  # after each step count: a partial result survives
            json.dump(results, fh, indent=2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_train_steps", type=int, default=600)
    parser.add_argument("--variance_types", default="fixed_small,learned_range")
    parser.add_argument("--ddpm_steps", default="25,50,100,1000")
    parser.add_argument("--num_samples", type=int, default=128, help="samples per step count")
    parser.add_argument("--num_samples_1000", type=int, default=64, help="samples at 1000 steps (the slow one)")
    parser.add_argument("--nll_timestep_stride", type=int, default=20, help="0: skip bits/dim")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "learned_variance"))
    args = parser.parse_args()
    for variance_type in args.variance_types.split(","):
        run_dir = os.path.join(args.out, variance_type)
        train(run_dir, args.max_train_steps, None, ["--variance_type", variance_type])
        results = measure(run_dir, variance_type, [int(s) for s in args.ddpm_steps.split(",")],
                          {"default": args.num_samples, 1000: args.num_samples_1000}, args.nll_timestep_stride)
        with open(run_dir.rstrip("/") + ".json", "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
