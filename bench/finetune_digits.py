#!/usr/bin/env python
"""Fine-tuning against training from scratch, at equal steps, on digits.

    python bench/finetune_digits.py --base_steps 500 --steps 200

A base model is trained on the digits 0-4, then fine-tuned on the digits 5-9 for --steps
(--pretrained_model_name_or_path, its fine-tuning recipe) while another model trains on 5-9 from
scratch for the same --steps (the digits recipe). Both sets of samples are scored as
bench/quality.py scores them (the classifier FID of a digit classifier's logits, DDIM 50, seed 1)
against real 5-9 digits that neither run trained on (the fifth quality.py holds out), and reported
as the ratio to the real-data floor (real training-split 5-9 digits vs those held-out ones).

The fine-tuning recipe's size rule (training/pretrained.py finetune_recipe) is measured with a
UNet of another size (--recipe: a YAML with its `model:`), --seed, and fine-tunes at the listed
--learning_rates (the recipe's rate and others) instead of the recipe's alone:

    python bench/finetune_digits.py --base_steps 150 --steps 75 --num_samples 500 --seed 1 \
        --recipe bench/digits_half_width.yaml --learning_rates 2e-4,5.1e-4 --no_scratch \
        --out bench/results/rule_half_width_seed1
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from quality import DigitScorer, classifier_fid, evaluate, real_digits, train  # noqa: E402
from snr_experiment import classifier_input  # noqa: E402


def split_datasets(out: str) -> dict:
    """save_to_disk folders of the training-split digits 0-4 and 5-9 (the held-out fifth excluded)."""
    from diffusion_extras.data import batch_order, decode_cache
    from diffusion_extras.data import images as data

    dataset = data.digits_dataset()
    split = batch_order.split_held_out(decode_cache.decode_dataset(dataset, "image", 16, True, 1),
                                       quality_validation_split(), 0)[0]
    labels = np.asarray(dataset["label"])
    folders = {}
    for name, keep in (("digits04", labels[split.rows] < 5), ("digits59", labels[split.rows] >= 5)):
        folders[name] = os.path.join(out, name)
        if not os.path.isdir(folders[name]):
            dataset.select(split.rows[keep].tolist()).save_to_disk(folders[name])
    return folders


def quality_validation_split() -> float:
    from quality import VALIDATION_SPLIT
    return VALIDATION_SPLIT


def scorer_for_5_to_9(num_samples: int) -> DigitScorer:
    """The digit classifier of quality.py (fitted on the whole training split), measuring against the
    held-out 5-9 digits, with their floor."""
    from sklearn.linear_model import LogisticRegression

    training, labels, held_out, held_out_labels = real_digits(None, [])
    classifier = LogisticRegression(max_iter=2000).fit(classifier_input(training), labels)
    real = training[labels >= 5]
    real = real[np.random.default_rng(1).permutation(len(real))[:num_samples]]
    reference = held_out[held_out_labels >= 5]
    return DigitScorer(classifier, reference, held_out_labels[held_out_labels >= 5],
                       classifier_fid(classifier, real, reference))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_steps", type=int, default=500, help="steps of the 0-4 base model")
    parser.add_argument("--steps", type=int, default=200, help="steps of both 5-9 runs (fine-tune and scratch)")
    parser.add_argument("--num_samples", type=int, default=1000, help="generated images scored per run")
    parser.add_argument("--recipe", default=None,
                        help="a training recipe YAML for the base and scratch runs (its `model:` sets the UNet "
                             "size); default: the digits recipe")
    parser.add_argument("--seed", type=int, default=0, help="--seed of every run")
    parser.add_argument("--learning_rates", default=None,
                        help="comma list: one fine-tune at each --learning_rate; default: one, at the recipe's")
    parser.add_argument("--no_scratch", action="store_true", help="skip the from-scratch 5-9 run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "finetune_digits"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    folders = split_datasets(args.out)
    seed = ["--seed", str(args.seed)]
    # quality.train adds --validation_split 0.2: each run holds out a fifth of its (already split) data
    base = os.path.join(args.out, f"base04-{args.base_steps}")
    seconds = {"base": train(base, args.base_steps, args.recipe, ["--dataset_name", folders["digits04"], *seed])}
    tune = ["--dataset_name", folders["digits59"], "--pretrained_model_name_or_path", base, *seed]
    runs = {"finetuned": (None, tune)} if args.learning_rates is None else {
        f"finetuned-lr{rate}": (None, [*tune, "--learning_rate", rate]) for rate in args.learning_rates.split(",")}
    if not args.no_scratch:
        runs["scratch"] = (args.recipe, ["--dataset_name", folders["digits59"], *seed])
    scorer = scorer_for_5_to_9(args.num_samples)
    result = {"base_steps": args.base_steps, "steps": args.steps, "num_samples": args.num_samples, "seed": args.seed,
              "recipe": args.recipe, "floor": scorer.floor, "reference_images": len(scorer.held_out), "runs": {}}
    for name, (recipe, flags) in runs.items():
        run_dir = os.path.join(args.out, f"{name}59-{args.steps}")
        seconds[name] = train(run_dir, args.steps, recipe, flags)
        scores = evaluate(run_dir, scorer, args.num_samples)
        result["runs"][name] = {"fid_classifier": scores["fid_classifier"],
                                "fid_ratio": scores["fid_classifier"] / scorer.floor,
                                "train_seconds": seconds[name]}
    result["base_train_seconds"] = seconds["base"]
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
