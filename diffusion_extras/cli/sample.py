"""Command line: sample images from a saved DDPMPipeline folder.

    python -m diffusion_extras.sample PIPELINE --num_images 16 --scheduler ddim --output DIR
"""
from __future__ import annotations

import argparse

from diffusion_extras.cli.common import (
    add_device_argument,
    load_pipeline,
    one_line_errors,
    pipeline_parser,
    positive_int,
    resolve_device,
)
from diffusion_extras.evaluation.sampling import DTYPES, SCHEDULERS, generate, make_scheduler, save_images


def parse_args(argv=None) -> argparse.Namespace:
    parser = pipeline_parser("sample", __doc__)
    parser.add_argument("--num_images", type=positive_int, default=16)
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="ddim",
                        help="ddpm: ancestral; ddim: eta=0; dpm: DPM-Solver++ (2M)")
    parser.add_argument("--num_inference_steps", type=positive_int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="image i uses noise seeded from (seed, i)")
    parser.add_argument("--batch_size", type=positive_int, default=16, help="images per UNet call")
    parser.add_argument("--output", required=True, help="folder for 000000.png ... and grid.png")
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="UNet precision; the sampler state stays fp32")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    with one_line_errors():
        device = resolve_device(args.device)
        pipeline = load_pipeline(args.pipeline, device=device, dtype=dtype)
        scheduler = make_scheduler(args.scheduler, pipeline.scheduler.config)
        images = generate(pipeline.unet, scheduler, args.num_images, args.num_inference_steps,
                          seed=args.seed, batch_size=args.batch_size, device=device,
                          dtype=dtype, progress=True)
        paths = save_images(images, args.output)
    print(f"wrote {len(images)} images and {paths[-1]}")
    return 0
