"""Command line: sample images from a saved DDPMPipeline folder.

    python -m diffusion_extras.sample PIPELINE --num_images 16 --scheduler ddim --output DIR
"""
from __future__ import annotations

import argparse
import sys

from diffusion_extras.sampling import (DTYPES, SCHEDULERS, generate, load_pipeline, make_scheduler,
                                       resolve_device, save_images)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m diffusion_extras.sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline", help="folder saved by train_ddpm.py (save_pretrained) or a Hub id")
    parser.add_argument("--num_images", type=positive_int, default=16)
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="ddim",
                        help="ddpm: ancestral; ddim: eta=0; dpm: DPM-Solver++ (2M)")
    parser.add_argument("--num_inference_steps", type=positive_int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="image i uses noise seeded from (seed, i)")
    parser.add_argument("--batch_size", type=positive_int, default=16, help="images per UNet call")
    parser.add_argument("--output", required=True, help="folder for 000000.png ... and grid.png")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="UNet precision; the sampler state stays fp32")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        pipeline = load_pipeline(args.pipeline, device=device, dtype=DTYPES[args.dtype])
        scheduler = make_scheduler(args.scheduler, pipeline.scheduler.config)
        images = generate(pipeline.unet, scheduler, args.num_images, args.num_inference_steps,
                          seed=args.seed, batch_size=args.batch_size, device=device,
                          dtype=DTYPES[args.dtype], progress=True)
        paths = save_images(images, args.output)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {len(images)} images and {paths[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
