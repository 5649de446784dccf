#!/usr/bin/env python
"""Benchmark train_ddpm.py's optimizer step. One process, one precision:

1. our full `optimizer_step` (EMA, min-SNR weights, diagnostics when the trainer has them, clipping,
   fused AdamW) against a bare step of the same model and batch (unet(noisy, t).sample, MSE,
   backward, the same fused AdamW), in interleaved rounds: the ratio is what our extras cost;
2. images/s the training DataLoader delivers (MicroBatches + to_model_input on the device)
   against the images/s the full step consumes;
3. model FLOPs per image, achieved TFLOP/s and MFU; on CUDA peak memory, and with
   --diffusers_script diffusers' train_unconditional.py run unmodified on the same UNet.

    OMP_NUM_THREADS=1 python bench/bench_step.py --recipe digits
    python bench/bench_step.py --recipe cifar10 --mixed_precision bf16 \
        --diffusers_script bench/vendor/train_unconditional.py

Flags after `--` go to train_ddpm's config parser (e.g. `-- --no-use_ema`). The cifar10 recipe
trains on synthetic 32 px images written here (no Hub): timing does not depend on the pixels. The
dit-latent recipe too, at 256 px with labels, through a VAE of sd-vae-ft-mse's config (as the Hub
stores it, tests/hub_configs/) with random weights: the latents are encoded once, before timing.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":  # not in a program that loads this module (a test): its environment stays its own
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub; fail fast instead of retrying
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_report  # noqa: E402
import device_figures  # noqa: E402
import diffusers_reference  # noqa: E402

from diffusion_extras.core import commands  # noqa: E402

TARGET_EXTRAS_PERCENT = 5.0  # the targets, set for the CPU digits recipe
TARGET_DATA_RATIO = 10.0
SD_VAE_CONFIG = os.path.join(ROOT, "tests", "hub_configs", "stabilityai--sd-vae-ft-mse", "config.json")
DIT_LATENT_FLAGS = ["--model_type", "dit", "--dit_size", "B/2", "--resolution", "256", "--class_conditional",
                    "--variance_type", "learned_range", "--train_batch_size", "64", "--mixed_precision", "bf16"]
DIT_LATENT_CLASSES = 1000  # ImageNet's, as DiT's label table
TINY_RECIPE = {  # hidden --tiny: the smoke test's 8 px UNet (~20k parameters)
    "resolution": 8, "train_batch_size": 8,
    "model": {"in_channels": 1, "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
              "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"],
              "norm_num_groups": 4, "dropout": 0.0}}


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("digits", "cifar10", "dit-latent"), default="digits",
                        help="dit-latent: DiT-B/2 (-- --dit_size XL/2 for XL/2) on 32x32x4 latents of 256 px "
                             "synthetic labelled images, a randomly initialised VAE of Stable Diffusion's shape, "
                             "learned sigma, as DiT trains on ImageNet")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps of each variant, in all")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant first")
    parser.add_argument("--rounds", type=int, default=20, help="alternating full/bare rounds the steps are split in")
    parser.add_argument("--json", help="results file (default: bench/results/RECIPE-DEVICE-PRECISION.json)")
    parser.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), help="default: the recipe's")
    parser.add_argument("--batch_size", type=int, help="images per micro-batch (default: the recipe's)")
    parser.add_argument("--snr_gamma", type=float, default=5.0, help="min-SNR gamma of the full step")
    parser.add_argument("--data_seconds", type=float, default=3.0, help="time spent measuring the data pipeline")
    parser.add_argument("--peak_tflops", type=float, help="dense bf16/fp16 peak for MFU (default: by GPU name)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler: which ops the extras add, per step")
    parser.add_argument("--diffusers_script", help="a copy of diffusers' train_unconditional.py (see bench/README.md)")
    parser.add_argument("--diffusers_steps", type=int, default=200, help="its timed optimizer steps")
    parser.add_argument("--diffusers_warmup", type=int, default=20, help="its untimed first steps")
    parser.add_argument("--diffusers_timeout", type=float, default=480.0, help="seconds before it is stopped")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv[:split])
    for name, least in (("steps", 1), ("warmup", 0), ("rounds", 1), ("batch_size", 1), ("diffusers_steps", 2),
                        ("diffusers_warmup", 0), ("data_seconds", 0.01), ("peak_tflops", 1e-9)):
        value = getattr(args, name)
        if value is not None and value < least:
            fail(f"--{name} must be at least {least} (got {value})")
    if args.diffusers_script and not os.path.isfile(args.diffusers_script):
        fail(f"--diffusers_script {args.diffusers_script}: no such file "
             "(copy diffusers' train_unconditional.py there, see bench/README.md)")
    return args, argv[split + 1:]


# ----------------------------------------------------------------------------- setup
def make_config(args, trainer_flags, workdir, compare=False):
    """The trainer's config; for the cifar10 recipe, after writing its synthetic images (the
    config parser refuses a --dataset_name folder that does not exist)."""
    import yaml

    from diffusion_extras.training.config import ConfigError, parse_config

    flags = ["--output_dir", os.path.join(workdir, "out"), "--cache_dir", os.path.join(workdir, "cache"),
             "--max_train_steps", str(10 ** 6), "--logger", "none", "--snr_gamma", str(args.snr_gamma)]
    if args.recipe == "dit-latent":
        flags += [*DIT_LATENT_FLAGS, "--pretrained_vae_model_name_or_path", write_random_vae(workdir, args.tiny)]
    elif args.tiny:
        path = os.path.join(workdir, "tiny.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(TINY_RECIPE, fh)
        flags += ["--config", path]
    elif args.recipe == "cifar10":
        flags += ["--config", os.path.join(ROOT, "configs", "cifar10-ddpm.yaml")]
    if args.mixed_precision:
        flags += ["--mixed_precision", args.mixed_precision]
    if args.batch_size:
        flags += ["--train_batch_size", str(args.batch_size)]
    try:
        config = parse_config(flags + trainer_flags)
        if (args.recipe == "cifar10" and not args.tiny) or args.recipe == "dit-latent":
            # Parsed once without a dataset (the embedded default) for the batch size and image shape.
            folder = os.path.join(workdir, "images")
            stop_at = args.diffusers_warmup + args.diffusers_steps
            count = config.train_batch_size * (stop_at + 2) if compare else max(4 * config.train_batch_size, 512)
            latent = args.recipe == "dit-latent"  # RGB images for the VAE, labelled
            channels = 3 if latent else config.model.get("in_channels", 3)
            write_synthetic_images(folder, count, config.resolution, channels,
                                   classes=DIT_LATENT_CLASSES if latent else None)
            config = parse_config(flags + ["--dataset_name", folder] + trainer_flags)
        return config
    except ConfigError as error:
        fail(str(error))


def write_synthetic_images(folder: str, count: int, resolution: int, channels: int, seed: int = 0,
                           classes: int | None = None) -> None:
    """Random uint8 images as one parquet file: both trainers load it with load_dataset(folder); with
    `classes`, a random label column of that many classes (a ClassLabel)."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (count, resolution, resolution, channels), np.uint8)
    columns = {"image": [Image.fromarray(p[:, :, 0] if channels == 1 else p) for p in pixels]}
    features = {"image": datasets.Image()}
    if classes:
        columns["label"] = rng.integers(0, classes, count).tolist()
        features["label"] = datasets.ClassLabel(num_classes=classes)
    os.makedirs(folder, exist_ok=True)
    dataset = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    dataset.to_parquet(os.path.join(folder, "train.parquet"))


def write_random_vae(workdir: str, tiny: bool = False) -> str:
    """An AutoencoderKL of sd-vae-ft-mse's config (factor 8, 4 latent channels) with random weights,
    saved in `workdir`: the cost of encoding is the shape's, not the weights'. `tiny`: its widths cut
    (8 channels a block, one layer each) for a CPU smoke run."""
    from diffusers import AutoencoderKL

    with open(SD_VAE_CONFIG) as fh:
        values = json.load(fh)
    if tiny:
        values.update(block_out_channels=[8] * len(values["block_out_channels"]), layers_per_block=1, norm_num_groups=4)
    folder = os.path.join(workdir, "vae")
    torch.manual_seed(0)
    AutoencoderKL.from_config(values).save_pretrained(folder)
    return folder


def make_run(config):
    from diffusion_extras.data import images as data
    from diffusion_extras.training import build, checkpointing
    from diffusion_extras.training.config import ConfigError

    try:
        return build.setup(config)
    except (ConfigError, data.DataError, checkpointing.CheckpointError) as error:
        fail(str(error))


def synchronizer(device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


# ----------------------------------------------------------------------------- the two steps
def full_step(run, batches: int = 4):
    """step.optimizer_step as train() calls it, on micro-batches made by the run's data
    source beforehand (loading is measured on its own, in measure_data_pipeline)."""
    from diffusion_extras.training import step

    made = list(itertools.islice(run.data.source.batches(0, batches), batches))
    if run.accelerator.device.type == "cuda":
        made = [batch.pin_memory() for batch in made]  # as the DataLoader's pin_memory=True delivers them
    cycle = itertools.cycle(made)
    return lambda: step.optimizer_step(run, cycle)


def bare_step(run):
    """The minimum a DDPM step must do, on one fixed noisy batch: forward, MSE, backward, AdamW."""

    from diffusion_extras.evaluation.pipeline_backbone import predict

    config, device = run.config, run.accelerator.device
    clean = model_input(run, next(run.data.source.batches(0, 1)), device)
    generator = torch.Generator(device).manual_seed(config.seed)
    noise = torch.randn(clean.shape, generator=generator, device=device)
    timesteps = torch.randint(0, run.objective.num_train_timesteps, (clean.shape[0],), generator=generator,
                              device=device)
    noisy = run.objective.add_noise(clean, noise, timesteps)
    # run.learner.unet carries accelerate's autocast under mixed precision; the optimizer is the same fused
    # AdamW without accelerate's wrapper (so no GradScaler: fp16 gradients may underflow, not overflow).
    unet, optimizer = run.learner.unet, run.learner.optimizer.optimizer

    def step():
        for _ in range(config.gradient_accumulation_steps):  # same images per step as the full one
            # the model's call (a DiT's "no class" label); a learned variance's extra channels left out
            F.mse_loss(predict(unet, noisy, timesteps)[:, :noise.shape[1]].float(), noise).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def model_input(run, batch, device, flips=None) -> torch.Tensor:
    """A micro-batch as the model's input: its images (a class-conditional batch's labels left out),
    or in a latent run the latents drawn from its stored posteriors (their means)."""
    from diffusion_extras.data import latents

    images = batch[0] if isinstance(batch, (list, tuple)) else batch
    return latents.model_input(images, device, flips, run.data.posterior)


def measure_steps(full, bare, args, synchronize) -> dict:
    """Seconds per optimizer step of each, per round. Rounds alternate which runs first (ABBA...),
    so a load change on a shared machine hits both alike; paired ratios cancel slow drifts."""
    for _ in range(args.warmup):
        full()
        bare()
    rounds = min(args.rounds, args.steps)
    counts = [args.steps // rounds + (r < args.steps % rounds) for r in range(rounds)]
    times = {"full": [], "bare": []}
    for r, count in enumerate(counts):
        order = (("full", full), ("bare", bare)) if r % 2 == 0 else (("bare", bare), ("full", full))
        for name, fn in order:
            times[name].append(device_figures.timed(fn, count, synchronize))
    return times


def summarize_steps(times: dict, images_per_step: int) -> dict:
    out = {}
    for name, values in times.items():
        median = statistics.median(values)
        out[name] = {"median_s": median, "min_s": min(values), "max_s": max(values), "rounds_s": values,
                     "images_per_s": images_per_step / median}
    paired = [f / b for f, b in zip(times["full"], times["bare"])]
    median_ratio = statistics.median(paired)
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    out["extras"] = {"paired_ratios": paired, "median_ratio": median_ratio,
                     "paired_ratio_quartiles": [quartiles[0], quartiles[2]],
                     "ratio_of_medians": out["full"]["median_s"] / out["bare"]["median_s"],
                     # interference from other jobs only adds time: the fastest rounds are the least disturbed
                     "ratio_of_minima": out["full"]["min_s"] / out["bare"]["min_s"],
                     "percent": 100.0 * (median_ratio - 1.0), "target_percent": TARGET_EXTRAS_PERCENT,
                     "meets_target": 100.0 * (median_ratio - 1.0) <= TARGET_EXTRAS_PERCENT}
    return out


# ----------------------------------------------------------------------------- data pipeline
def measure_data_pipeline(run, seconds: float, synchronize, windows: int = 3) -> dict:
    """The DataLoader train() builds, read as fast as it goes, each batch made model input on the device."""
    from diffusion_extras.training import loop

    config, device = run.config, run.accelerator.device
    batches = loop.make_batches(run)
    flips = (torch.rand(config.train_batch_size, device=device) < 0.5) if config.random_flip else None
    model_input(run, next(batches), device, flips)  # worker start-up is not throughput
    rates = []
    for _ in range(windows):
        synchronize()
        start, images = time.perf_counter(), 0
        while images == 0 or time.perf_counter() - start < seconds / windows:
            batch = next(batches)
            images += len(model_input(run, batch, device, flips))
        synchronize()
        rates.append(images / (time.perf_counter() - start))
    del batches
    return {"images_per_s": statistics.median(rates), "windows_images_per_s": rates,
            "num_workers": config.dataloader_num_workers}


# ----------------------------------------------------------------------------- main
@commands.leaves_the_process_as_found  # a program may call it (a test does): accelerate's state reset after
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, trainer_flags = parse_args(argv)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_step-") as workdir:
        compare = bool(args.diffusers_script) and torch.cuda.is_available()
        config = make_config(args, trainer_flags, workdir, compare)
        run = make_run(config)
        results = measure(args, config, run, workdir)
        results["machine"] = bench_report.machine_info(run.accelerator.device, load_start)
    results = {"command": bench_report.command_line(__file__, argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               **results}
    print(bench_report.table(results))
    path = args.json or os.path.join(ROOT, "bench", "results", "{}-{}-{}.json".format(
        "tiny" if args.tiny else args.recipe, results["machine"]["device"], config.mixed_precision))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=float)
    print(f"wrote {path}")
    return 0


def measure(args, config, run, workdir) -> dict:
    device = run.accelerator.device
    synchronize = synchronizer(device)
    full, bare = full_step(run), bare_step(run)
    images_per_step = config.train_batch_size * config.gradient_accumulation_steps
    flops = device_figures.count_flops(run)
    steps = summarize_steps(measure_steps(full, bare, args, synchronize), images_per_step)
    pipeline = measure_data_pipeline(run, args.data_seconds, synchronize)
    pipeline["consumed_images_per_s"] = steps["full"]["images_per_s"]
    pipeline["ratio"] = pipeline["images_per_s"] / pipeline["consumed_images_per_s"]
    pipeline.update(target_ratio=TARGET_DATA_RATIO, meets_target=pipeline["ratio"] >= TARGET_DATA_RATIO)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = device_figures.peak_tflops(gpu_name, args.peak_tflops)
    for name in ("full", "bare"):
        achieved = flops["gflop_per_image_fwd_bwd"] * steps[name]["images_per_s"] / 1e3
        flops[f"achieved_tflops_{name}"] = achieved
        flops[f"mfu_{name}"] = achieved / peak if peak else None
    flops["peak_tflops"] = peak
    results = {"config": bench_report.config_summary(args, config, run), "step": steps, "data": pipeline,
               "flops": flops, "gpu": None, "profile": None, "notes": []}
    if device.type == "cuda":
        results["gpu"] = device_figures.cuda_memory(full, bare, device)
        if config.mixed_precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if config.mixed_precision == "bf16" else torch.float16
            results["gpu"]["matmul_tflops_measured"] = device_figures.matmul_tflops(device, dtype)
    if args.profile:
        results["profile"] = device_figures.profile_extras(full, bare, max(2, min(args.steps, 5)), device,
                                                           synchronize)
    finite = all(bool(torch.isfinite(p).all()) for p in run.learner.unet.parameters())
    results["sanity"] = {"weights_finite_after": finite}
    results["diffusers"] = diffusers_reference.run_reference(args, config, workdir, os.path.join(workdir, "images"),
                                                             steps["full"]["images_per_s"])
    results["notes"] += bench_report.notes(results, device)
    return results


if __name__ == "__main__":
    sys.exit(main())
