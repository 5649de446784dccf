#!/usr/bin/env python
"""The cost of conditioning on an image: seconds per optimizer step of a --conditioning run of each
kind against the unconditional run of the same recipe (the digits recipe by default: one process,
its batch and model size, the same digits),
each the trainer's full `optimizer_step` on micro-batches made beforehand, in interleaved rounds
(bench_step.measure_steps: a load change hits both alike; the paired ratios cancel slow drifts).
What the condition adds: its channels in the UNet's first convolution, and making it in the step
(super-resolution's down- and upsampling, inpainting's masks drawn on the CPU, a latent run's
encoding of the condition by the VAE).

    python bench/conditioning_cost.py                       # every kind, one after the other
    python bench/conditioning_cost.py --kind inpainting -- --mixed_precision bf16

A timing: run it on a quiet machine. Flags after `--` go to both runs' config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402

from diffusion_extras.evaluation.choices import CONDITIONING_KINDS  # noqa: E402


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("all", *CONDITIONING_KINDS), default="all",
                        help="the kind measured against the unconditional run (default: each in turn)")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps of each run, in all")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each run first")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds the steps are split in")
    parser.add_argument("--json", help="results file (default: bench/results/conditioning-cost.json)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the smoke test's 8 px UNet
    args = parser.parse_args(argv[:split])
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            bench_step.fail(f"--{name} must be at least 1")
    return args, argv[split + 1:]


def kind_flags(kind: str, workdir: str) -> list[str]:
    """The flags of a --conditioning run on the embedded digits: image-to-image pairs each digit
    with itself inverted, written as a dataset with a conditioning image column."""
    if kind != "image":
        return ["--conditioning", kind]  # super_resolution: the default --sr_factor 4
    import datasets
    import numpy as np
    from PIL import Image

    from diffusion_extras.data.images import digits_dataset
    digits = digits_dataset().cast_column("image", datasets.Image())
    pairs = [Image.fromarray(255 - np.asarray(image.convert("L"))) for image in digits["image"]]
    folder = os.path.join(workdir, "pairs")
    datasets.Dataset.from_dict({"image": digits["image"], "condition": pairs},
                               features=datasets.Features({"image": datasets.Image(),
                                                           "condition": datasets.Image()})).save_to_disk(folder)
    return ["--dataset_name", folder, "--conditioning", "image", "--conditioning_image_column", "condition"]


def main(argv=None) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    args, trainer_flags = parse_args(argv)
    kinds = CONDITIONING_KINDS if args.kind == "all" else (args.kind,)
    step_args = argparse.Namespace(tiny=args.tiny, recipe="digits", mixed_precision=None, batch_size=None,
                                   snr_gamma=5.0, steps=args.steps, warmup=args.warmup, rounds=args.rounds)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        runs = {}
        for name in ("unconditional", *kinds):
            flags = [] if name == "unconditional" else kind_flags(name, workdir)
            AcceleratorState._reset_state(True), GradientState._reset_state()  # another run in this process
            os.makedirs(os.path.join(workdir, name))
            runs[name] = bench_step.make_run(bench_step.make_config(step_args, flags + trainer_flags,
                                                                    os.path.join(workdir, name)))
        synchronize = bench_step.synchronizer(runs["unconditional"].accelerator.device)
        unconditional = bench_step.full_step(runs["unconditional"])
        for kind in kinds:
            times = bench_step.measure_steps(bench_step.full_step(runs[kind]), unconditional, step_args, synchronize)
            config = runs[kind].config
            images = config.train_batch_size * config.gradient_accumulation_steps
            summary = bench_step.summarize_steps(times, images)
            results[kind] = {"images_per_step": images, "conditional_s_per_step": summary["full"]["median_s"],
                             "unconditional_s_per_step": summary["bare"]["median_s"],
                             "median_paired_ratio": summary["extras"]["median_ratio"],
                             "ratio_of_minima": summary["extras"]["ratio_of_minima"], "rounds": summary}
            print(f"{kind}: {results[kind]['conditional_s_per_step'] * 1e3:.1f} ms/step against "
                  f"{results[kind]['unconditional_s_per_step'] * 1e3:.1f} ms unconditional: "
                  f"x{results[kind]['median_paired_ratio']:.3f} (median of {len(times['full'])} paired rounds; "
                  f"ratio of minima x{results[kind]['ratio_of_minima']:.3f})")
    result = {"trainer_flags": trainer_flags, "kinds": results}
    path = args.json or os.path.join(bench_step.ROOT, "bench", "results", "conditioning-cost.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
