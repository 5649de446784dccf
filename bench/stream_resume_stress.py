#!/usr/bin/env python
"""Exact resume of a streamed run, from every checkpoint.

Writes webdataset .tar shards of scikit-learn digits (JPEG), trains a straight streamed run with
DataLoader workers that crosses several per-worker epochs with a checkpoint every --every steps,
then, for each checkpoint, resumes a copy of the output folder holding only the checkpoints up to
it and compares the final UNet weights with the straight run's. Prints one row per checkpoint
(max |weight difference|, first step whose logged loss differs) and exits 1 if any differs.

    OMP_NUM_THREADS=1 python bench/stream_resume_stress.py                 # the issue's recipe
    python bench/stream_resume_stress.py --workers 3 --shuffle_buffer_size 16 --steps 60 --every 7
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tests' shard writer, tiny recipe and CLI runner

from helpers import load_unet_weights, read_history, run_training, write_tar_shards, write_tiny_recipe  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="--dataloader_num_workers")
    parser.add_argument("--shards", type=int, default=4, help=".tar shards written")
    parser.add_argument("--per_shard", type=int, default=30, help="digits per shard")
    parser.add_argument("--batch", type=int, default=8, help="--train_batch_size")
    parser.add_argument("--resolution", type=int, default=16, help="--resolution (px)")
    parser.add_argument("--steps", type=int, default=120, help="--max_train_steps of the straight run")
    parser.add_argument("--every", type=int, default=23, help="--checkpointing_steps")
    parser.add_argument("--seed", type=int, default=6, help="--seed")
    parser.add_argument("--shuffle_buffer_size", type=int, default=0, help="--shuffle_buffer_size (0: off)")
    parser.add_argument("--folder", default=None, help="work folder (default: a temporary one, removed)")
    return parser.parse_args(argv)


def write_digit_shards(folder: str, shards: int, per_shard: int) -> str:
    from sklearn.datasets import load_digits
    pixels = (load_digits().images[: shards * per_shard] * (255.0 / 16.0)).round().astype("uint8")
    return write_tar_shards(folder, shards=shards, per_shard=per_shard, pixels=pixels)


def first_loss_difference(straight: str, resumed: str) -> int | None:
    a = {h["step"]: h["loss"] for h in read_history(straight)}
    b = {h["step"]: h["loss"] for h in read_history(resumed)}
    return next((step for step in sorted(b) if a.get(step) != b[step]), None)


def resume_from(straight: str, step: int, folder: str, recipe: str, flags: list) -> tuple[float, int | None]:
    """Resume a copy of `straight` that holds checkpoints up to `step`; the max weight difference
    of its final UNet against the straight run's, and the first step whose loss differs."""
    resumed = os.path.join(folder, f"resumed-{step}")
    shutil.copytree(straight, resumed)
    for name in os.listdir(resumed):
        if name.startswith("checkpoint-") and int(name.split("-")[1]) > step:
            shutil.rmtree(os.path.join(resumed, name))
    run_training(folder, recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    wa, wb = load_unet_weights(straight), load_unet_weights(resumed)
    difference = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    return difference, first_loss_difference(straight, resumed)


def main(argv=None) -> int:
    args = parse_args(argv)
    folder = pathlib.Path(args.folder or tempfile.mkdtemp(prefix="stream-resume-"))  # run_training wants a Path
    os.makedirs(folder, exist_ok=True)
    shards = write_digit_shards(os.path.join(folder, "shards"), args.shards, args.per_shard)
    recipe = write_tiny_recipe(folder, resolution=args.resolution, train_batch_size=args.batch,
                               checkpointing_steps=args.every, max_train_samples=None, diagnostics_steps=1)
    flags = ["--train_data_files", f"{shards}/train-*.tar", "--streaming", "--dataloader_num_workers", args.workers,
             "--shuffle_buffer_size", args.shuffle_buffer_size, "--max_train_steps", args.steps, "--seed", args.seed]
    straight = os.path.join(folder, "straight")
    run_training(folder, recipe, straight, *flags)
    per_worker = args.shards * args.per_shard / max(args.workers, 1)
    print(f"# {datetime.date.today()}  {' '.join(sys.argv)}")
    print(f"# {args.shards} shards x {args.per_shard} digits, {args.workers} workers "
          f"(~{per_worker:g} images per worker epoch), batch {args.batch}, {args.steps} steps")
    print("| resumed from | max weight diff | first loss diff |")
    print("|---:|---:|---:|")
    failures = 0
    for step in range(args.every, args.steps, args.every):
        difference, first = resume_from(straight, step, folder, recipe, flags)
        failures += difference != 0.0
        print(f"| {step} | {difference:.3g} | {first if first is not None else '-'} |", flush=True)
    if args.folder is None:
        shutil.rmtree(folder)
    print("all bit-identical" if not failures else f"{failures} resume(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
