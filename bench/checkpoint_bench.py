#!/usr/bin/env python
"""Checkpoint size and save / load time for a recipe (default: the CIFAR-10 DDPM, 35.7M params).

    python bench/checkpoint_bench.py [--recipe configs/cifar10-ddpm.yaml] [--repeats 3] [--json out.json]

Builds the run exactly as build.setup does (model, fused AdamW, LR schedule, EMA,
diagnostics) on synthetic 32 px images, takes one optimizer step so the Adam moments exist, then
times diffusion_extras.training.checkpointing.save_checkpoint (accelerate's save_state + fsync + marker +
rename) with and without the marker's per-file checksums, verify_checkpoint (what `latest` runs
on each candidate) and accelerator.load_state, and lists the checkpoint's files and sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=os.path.join(ROOT, "configs", "cifar10-ddpm.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    from PIL import Image

    from diffusion_extras.training import build, checkpointing, loop, models, step
    from diffusion_extras.training.config import parse_config

    work = tempfile.mkdtemp(prefix="ckpt-bench-")
    images = os.path.join(work, "images")
    os.makedirs(images)
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(os.path.join(images, f"{i}.png"))
    config = parse_config(["--config", args.recipe, "--dataset_name", "", "--train_data_dir", images,
                           "--output_dir", os.path.join(work, "run"), "--train_batch_size", "2",
                           "--mixed_precision", "no", "--logger", "none", "--dataloader_num_workers", "0"])
    run = build.setup(config)
    step.optimizer_step(run, loop.make_batches(run))
    saves, plain_saves, verifies, loads, path = [], [], [], [], None
    for repeat in range(args.repeats):
        started = time.perf_counter()
        checkpointing.save_checkpoint(run.accelerator, config.output_dir, 1000 + repeat, loop.train_state(run),
                                      checksums=False)
        plain_saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        path = checkpointing.save_checkpoint(run.accelerator, config.output_dir, run.progress.global_step + repeat,
                                             loop.train_state(run))
        saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert checkpointing.verify_checkpoint(path) is None
        verifies.append(time.perf_counter() - started)
        started = time.perf_counter()
        run.accelerator.load_state(path)
        loads.append(time.perf_counter() - started)
    files = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}
    result = {"recipe": os.path.relpath(args.recipe, ROOT),
              "unet_parameters": models.count_parameters(run.accelerator.unwrap_model(run.learner.unet)),
              "checkpoint_bytes": sum(files.values()), "files": files,
              "save_seconds_median": statistics.median(saves), "load_seconds_median": statistics.median(loads),
              "save_without_checksums_seconds_median": statistics.median(plain_saves),
              "verify_seconds_median": statistics.median(verifies),
              "checksum": checkpointing.file_checksum(os.path.join(path, "model.safetensors")).split(":")[0],
              "save_seconds": saves, "save_without_checksums_seconds": plain_saves, "verify_seconds": verifies,
              "load_seconds": loads, "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"{result['recipe']}: {result['unet_parameters'] / 1e6:.1f}M params, checkpoint "
          f"{result['checkpoint_bytes'] / 2**20:.1f} MiB; save {result['save_seconds_median']:.2f} s with "
          f"{result['checksum']} checksums, {result['save_without_checksums_seconds_median']:.2f} s without; "
          f"verify {result['verify_seconds_median']:.2f} s; load {result['load_seconds_median']:.2f} s "
          f"(median of {args.repeats})")
    for name, size in files.items():
        print(f"  {name:32s} {size / 2**20:9.2f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
