"""Command line: FID / KID / FD-DINOv2 / CMMD of a saved DDPMPipeline against a folder of images or
saved statistics (an .npz serves one extractor; a folder serves any), and nll: the bits/dim of the
reference images under the model (the variational bound, evaluation/likelihood.py).

    python -m diffusion_extras.evaluate PIPELINE --reference DIR_OR_STATS.npz --num_samples 10000 \\
        --eval_metrics fid,kid,fd_dinov2,cmmd
    python -m diffusion_extras.evaluate PIPELINE --reference IMAGE_DIR --eval_metrics nll
"""
from __future__ import annotations

import argparse
import json
import os

from diffusion_extras.cli.common import (
    add_device_argument,
    load_images,
    load_pipeline,
    load_reference,
    one_line_errors,
    pipeline_parser,
    pipeline_resolution,
    positive_int,
    resolve_device,
)
from diffusion_extras.evaluation import likelihood
from diffusion_extras.evaluation.backbones import CLIP_DEFAULT, DINOV2_DEFAULT
from diffusion_extras.evaluation.metrics import (
    build_feature_extractor,
    evaluate_unet_metrics,
    extractors_for,
    parse_metrics,
)
from diffusion_extras.evaluation.sampling import SCHEDULERS, make_scheduler


def parse_args(argv=None) -> argparse.Namespace:
    parser = pipeline_parser("evaluate", __doc__)
    parser.add_argument("--reference", required=True,
                        help="folder of reference images (resized to the model resolution) or a stats .npz")
    parser.add_argument("--num_samples", type=positive_int, default=10000, help="generated images")
    parser.add_argument("--eval_metrics", default="fid,kid",
                        help="comma list of fid, kid, fd_dinov2, cmmd, nll (bits/dim of the --reference images)")
    parser.add_argument("--nll_timestep_stride", type=positive_int, default=1,
                        help="nll: 1 sums the bound over all T timesteps (T UNet calls per image); k > 1 estimates "
                             "the KL terms from every k-th (T/k calls per image)")
    parser.add_argument("--feature_extractor", choices=("inception", "tiny"), default="inception",
                        help="features of fid/kid; tiny: random conv net for smoke tests, NOT comparable "
                             "with published numbers")
    parser.add_argument("--inception_weights", default=None,
                        help="TorchScript inception-2015-12-05.pt (StyleGAN2-ADA / clean-fid detector); "
                             "default: downloaded once into the Hugging Face cache folder")
    parser.add_argument("--dinov2_model", default=DINOV2_DEFAULT, help="Hub id or local folder for fd_dinov2")
    parser.add_argument("--clip_model", default=CLIP_DEFAULT, help="Hub id or local folder for cmmd")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="ddim")
    parser.add_argument("--num_inference_steps", type=positive_int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=positive_int, default=64, help="images per UNet call")
    parser.add_argument("--cache_dir", default=None, help="where reference statistics are cached")
    parser.add_argument("--output", default=None, help="metrics JSON file")
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with one_line_errors():
        device = resolve_device(args.device)
        names = [m.strip() for m in args.eval_metrics.split(",") if m.strip()]
        sampled = [m for m in names if m != "nll"]  # nll scores the reference images; the rest sample
        groups = extractors_for(parse_metrics(",".join(sampled)), args.feature_extractor) if sampled else {}
        if not names:
            raise ValueError(f"--eval_metrics {args.eval_metrics!r}: name at least one metric")
        pipeline = load_pipeline(args.pipeline, device=device)
        resolution = pipeline_resolution(pipeline)
        report = {"reference": args.reference, "pipeline": args.pipeline, "seed": args.seed}
        if "nll" in names:
            images = load_images(args.reference, resolution, pipeline.unet.config.in_channels)
            report.update(likelihood.bits_per_dim(pipeline.unet, pipeline.scheduler, images, args.batch_size,
                                                  device, args.seed, args.nll_timestep_stride))
        if groups:
            report.update(sample_metrics(args, pipeline, groups, resolution, device))
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


def sample_metrics(args, pipeline, groups: dict, resolution: int, device) -> dict:
    """FID / KID / FD-DINOv2 / CMMD of sampled images against the reference, and how they were sampled."""
    suites = []
    for kind, metrics in groups.items():
        extractor = build_feature_extractor(kind, args.inception_weights, device,
                                            model={"dinov2": args.dinov2_model, "clip": args.clip_model}.get(kind))
        reference = load_reference(args.reference, extractor, resolution, args.cache_dir, args.batch_size)
        suites.append((extractor, reference, metrics))
    scheduler = make_scheduler(args.scheduler, pipeline.scheduler.config)
    metrics = evaluate_unet_metrics(pipeline.unet, scheduler, suites, args.num_samples,
                                    args.num_inference_steps, args.seed, args.batch_size, device)
    return {**metrics, "feature_extractors": {m: e.name for e, _, group in suites for m in group},
            "reference_images": reference.num_images, "scheduler": args.scheduler,
            "num_inference_steps": args.num_inference_steps}
