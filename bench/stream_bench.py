#!/usr/bin/env python
"""Images/s the streaming path delivers (JPEG .tar shards -> decoded, resized, batched uint8)
with 0, 1, 2 DataLoader workers, beside what one GPU consumes on the ddpm-64 / ddpm-256 recipes.

    OMP_NUM_THREADS=1 python bench/stream_bench.py --resolutions 64 256 --workers 0 1 2

The consumption side is an ESTIMATE, not a measurement: the recipe UNet's forward+backward FLOPs
per image (FlopCounterMode on the meta device: no weights, no time) at --mfu (default 40%) of an
H100's dense bf16 peak. Delivered images/s per worker then say how many cores one GPU needs.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch
import yaml
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from diffusion_extras.data import streaming  # noqa: E402
from diffusion_extras.training.config import TrainConfig  # noqa: E402

H100_BF16_PEAK_TFLOPS = 989.4  # dense, spec sheet (bench/device_figures.PEAK_TFLOPS)
RECIPES = {64: "configs/ddpm-64.yaml", 256: "configs/ddpm-256.yaml"}


def write_jpeg_shards(folder: str, resolution: int, images: int, shards: int = 8) -> str:
    """Photo-like JPEGs (smooth gradients plus noise, quality 90) 1.25x the training size, so each
    one is decoded, resized and cropped as real data would be."""
    rng = np.random.default_rng(0)
    size = resolution * 5 // 4
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    per_shard = images // shards
    for shard in range(shards):
        with tarfile.open(os.path.join(folder, f"train-{shard:03d}.tar"), "w") as tar:
            for i in range(per_shard):
                base = (ramp[None, :, None] * rng.uniform(0.3, 1, 3) + ramp[:, None, None] * rng.uniform(0, 0.7, 3))
                pixels = np.clip(base / 2 + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
                encoded = io.BytesIO()
                Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
                info = tarfile.TarInfo(f"{shard:03d}{i:05d}.jpg")
                info.size = len(encoded.getvalue())
                tar.addfile(info, io.BytesIO(encoded.getvalue()))
    return os.path.join(folder, "train-*.tar")


def delivered_images_per_second(files: str, resolution: int, workers: int, batch_size: int, batches: int) -> float:
    """Batches read as fast as they come, after the first (worker start-up is not throughput)."""
    config = TrainConfig(train_data_files=files, streaming=True, shuffle_buffer_size=0, resolution=resolution)
    stream, column = streaming.load_stream(config, 0, 1)
    source = streaming.StreamingBatches(stream, column, batch_size, resolution, True, 3, seed=0, num_workers=workers)
    next(source)
    start = time.perf_counter()
    for _ in range(batches):
        next(source)
    return batches * batch_size / (time.perf_counter() - start)


def recipe_gflop_per_image(path: str) -> float:
    """Forward+backward model FLOPs of one image for a recipe's UNet, counted on the meta device."""
    from diffusers import UNet2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with open(os.path.join(ROOT, path)) as fh:
        recipe = yaml.safe_load(fh)
    with torch.device("meta"):
        unet = UNet2DModel(sample_size=recipe["resolution"], **recipe["model"])
        sample = torch.randn(1, unet.config.in_channels, recipe["resolution"], recipe["resolution"])
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel([SDPBackend.MATH]):
            unet(sample, torch.tensor([10])).sample.float().square().mean().backward()
    return counter.get_total_flops() / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--images", type=int, default=512, help="images in the shards per resolution")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed fraction of the bf16 peak the GPU reaches")
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "stream_bench.json"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    results = {"command": " ".join(["python", "bench/stream_bench.py", *argv]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
               platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(), "rows": []}
    for resolution in args.resolutions:
        gflop = recipe_gflop_per_image(RECIPES[resolution]) if resolution in RECIPES else None
        consumed = args.mfu * H100_BF16_PEAK_TFLOPS * 1e3 / gflop if gflop else None
        with tempfile.TemporaryDirectory() as folder:
            files = write_jpeg_shards(folder, resolution, args.images)
            for workers in args.workers:
                rate = delivered_images_per_second(files, resolution, workers, args.batch_size, args.batches)
                row = {"resolution": resolution, "workers": workers, "delivered_images_per_s": rate,
                       "recipe_gflop_per_image_fwd_bwd": gflop, "estimated_gpu_images_per_s": consumed}
                results["rows"].append(row)
                print(f"{resolution:4d} px  workers {workers}  delivered {rate:8.1f} img/s"
                      + (f"   one H100 at {args.mfu:.0%} of bf16 peak eats ~{consumed:,.0f} img/s "
                         f"({gflop:.1f} GFLOP/img fwd+bwd): ~{consumed / max(rate, 1e-9):.0f}x this" if gflop else ""),
                      flush=True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"load average {results['load_average']}; results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
