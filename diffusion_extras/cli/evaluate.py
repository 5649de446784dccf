"""Command line: FID / KID / FD-DINOv2 / CMMD of a saved DDPMPipeline or ClassConditionalPipeline
against a folder of images or saved statistics (an .npz serves one extractor; a folder serves any),
and nll: the bits/dim of the reference images under the model (the variational bound,
evaluation/likelihood.py). A class-conditional pipeline draws class-balanced samples (sample i of
class i mod the number of classes, as the trainer's FID does), guided at --guidance_scale.

An image-conditioned pipeline samples the conditions of the --reference images (a folder: the
ground truth, up to --num_samples of them): super-resolution their degraded low-resolution
versions, inpainting the images under --masks (or --mask), image-to-image the --conditioning_images
at the same relative paths. Reported: psnr and ssim of the samples against the references
(super-resolution also bicubic_psnr, bicubic_ssim), for scikit-learn's digits a digit classifier's
accuracy on the samples and on the references, the --eval_metrics against the reference folder,
and with --baseline an unconditional pipeline's inpainting (the replacement method) scored alike.

    python -m diffusion_extras.evaluate PIPELINE --reference DIR_OR_STATS.npz --num_samples 10000 \\
        --eval_metrics fid,kid,fd_dinov2,cmmd [--guidance_scale 2] [--guidance_interval 0.3,5] [--guide DIR]
    python -m diffusion_extras.evaluate PIPELINE --reference IMAGE_DIR --eval_metrics nll

Under a multi-process launch (`torchrun --nproc_per_node 8 -m diffusion_extras.evaluate ...`) every
rank samples its share of the seeded images (the images of one process, bitwise on CPU) on its own
device, and rank 0 gathers the features, scores them and writes the report (nll runs on rank 0).
"""
from __future__ import annotations

import argparse
import json
import os

from diffusion_extras.cli.arguments import (
    add_condition_arguments,
    add_device_argument,
    add_guidance_arguments,
    add_sampler_arguments,
    one_line_errors,
    pipeline_parser,
    positive_int,
)
from diffusion_extras.cli.inputs import (
    check_conditioning_flags,
    check_pipeline_argument,
    check_reference,
    local_pipeline_folder,
    pipeline_conditioning,
    saved_conditioning,
)
from diffusion_extras.core.commands import importing_the_stack, leaves_the_process_as_found
from diffusion_extras.data.spec import Resolution
from diffusion_extras.evaluation import distributed
from diffusion_extras.evaluation.choices import CLIP_DEFAULT, DINOV2_DEFAULT, extractors_for, parse_metrics
from diffusion_extras.evaluation.inception_file import check_inception_reachable


def build_parser() -> argparse.ArgumentParser:
    parser = pipeline_parser("evaluate", __doc__)
    parser.add_argument("--reference", required=True,
                        help="folder of reference images (resized and centre-cropped to the model resolution, as "
                             "training images are) or a stats .npz")
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
    add_sampler_arguments(parser)
    parser.add_argument("--batch_size", type=positive_int, default=64, help="images per UNet call")
    add_guidance_arguments(parser)
    add_condition_arguments(parser, "image-to-image pipelines: the conditioning images, the files at the relative "
                                    "paths of the --reference images")
    parser.add_argument("--baseline", default=None, metavar="PIPELINE",
                        help="inpainting: also score an unconditional pipeline's completions of the same masks (the "
                             "replacement method), prefixed baseline_")
    parser.add_argument("--cache_dir", default=None, help="where reference statistics are cached")
    parser.add_argument("--output", default=None, help="metrics JSON file")
    add_device_argument(parser)
    return parser


@leaves_the_process_as_found
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_errors():  # a missing file, a misplaced flag or no detector offline answer at once too
        folder = check_pipeline_argument(args)
        check_reference(args.reference)
        if folder is not None:
            check_conditioning_flags(saved_conditioning(folder), args, needs_images=("image",))
        if args.baseline is not None:
            local_pipeline_folder(args.baseline)
        names = [m.strip() for m in args.eval_metrics.split(",") if m.strip()]
        sampled = [m for m in names if m != "nll"]  # nll scores the reference images; the rest sample
        groups = extractors_for(parse_metrics(",".join(sampled)), args.feature_extractor) if sampled else {}
        if not names:
            raise ValueError(f"--eval_metrics {args.eval_metrics!r}: name at least one metric")
        check_inception_reachable(groups, args.inception_weights)
    # torch, diffusers, scipy (seconds) once the flags and the files are good
    with importing_the_stack():
        from diffusion_extras.cli.common import guidance_for, load_images, load_pipeline, pipeline_resolution
        from diffusion_extras.evaluation import likelihood
        from diffusion_extras.evaluation.pipeline_backbone import pipeline_model
        from diffusion_extras.evaluation.pipeline_class_conditional import is_flow_scheduler
        from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline

    rank, num_ranks = distributed.launched_ranks()
    with one_line_errors():
        device = launch_device(args.device, num_ranks)
        pipeline = load_pipeline(args.pipeline, device=device)
        check_conditioning_flags(pipeline_conditioning(pipeline), args, needs_images=("image",))  # a Hub id's too
        guidance = guidance_for(pipeline, args, device)  # refused by an unconditional one without a guide
        num_classes = len(pipeline.id2label) if getattr(pipeline, "id2label", None) else None
        resolution = pipeline_resolution(pipeline)
        conditioned = isinstance(pipeline, ImageConditionedPipeline)
        if "nll" in names and (num_classes or conditioned):
            raise ValueError("--eval_metrics nll scores unconditional pipelines only; drop nll for this "
                             f"{'image' if conditioned else 'class'}-conditional one")
        if "nll" in names and getattr(pipeline, "vae", None) is not None:
            raise ValueError("--eval_metrics nll scores pixel pipelines (the bound of a latent one is in latents, "
                             "not image bits); drop nll for this latent one")
        if "nll" in names and is_flow_scheduler(pipeline.scheduler):
            raise ValueError("--eval_metrics nll is DDPM's variational bound; a flow-matching model "
                             f"({type(pipeline.scheduler).__name__}) has no such bound here: drop nll")
        report = {"reference": args.reference, "pipeline": args.pipeline, "seed": args.seed}
        if "nll" in names and rank == 0:
            images = load_images(args.reference, resolution, pipeline_model(pipeline).config.in_channels)
            report.update(likelihood.bits_per_dim(pipeline_model(pipeline), pipeline.scheduler, images, args.batch_size,
                                                  device, args.seed, args.nll_timestep_stride))
        if conditioned:
            report.update(conditioned_metrics(args, pipeline, groups, resolution, device, rank, num_ranks, guidance))
        elif groups:
            report.update(sample_metrics(args, pipeline, groups, resolution, device, rank, num_ranks, num_classes,
                                         guidance))
        if rank != 0:
            return 0
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


def launch_device(name: str, num_ranks: int):
    """--device for one process; under a multi-process launch, this rank's device (its GPU, or the
    CPU) once the process group is up (accelerate's PartialState reads the launcher's variables)."""
    from diffusion_extras.cli.common import resolve_device

    if num_ranks == 1:
        return resolve_device(name)
    from accelerate import PartialState
    return PartialState(cpu=resolve_device(name).type == "cpu").device


def sample_metrics(args, pipeline, groups: dict, resolution: Resolution, device, rank: int, num_ranks: int,
                   num_classes: int | None, guidance: dict) -> dict:
    """FID / KID / FD-DINOv2 / CMMD of sampled images against the reference, and how they were
    sampled; every rank samples its share, rank 0 scores (the others get {})."""
    from diffusion_extras.cli.common import load_reference
    from diffusion_extras.evaluation.metrics import build_feature_extractor, evaluate_unet_metrics
    from diffusion_extras.evaluation.pipeline_backbone import pipeline_model
    from diffusion_extras.evaluation.sampling import default_scheduler, make_scheduler

    suites = []
    for kind, wanted in groups.items():
        extractor = build_feature_extractor(kind, args.inception_weights, device,
                                            model={"dinov2": args.dinov2_model, "clip": args.clip_model}.get(kind))
        reference = (load_reference(args.reference, extractor, resolution, args.cache_dir, args.batch_size)
                     if rank == 0 else None)  # the other ranks only extract features
        suites.append((extractor, reference, wanted))
    sampler = args.scheduler or default_scheduler(pipeline.scheduler.config)
    scheduler = make_scheduler(sampler, pipeline.scheduler.config, args.timestep_spacing)
    metrics = evaluate_unet_metrics(pipeline_model(pipeline), scheduler, suites, args.num_samples,
                                    args.num_inference_steps, args.seed, args.batch_size, device, num_classes,
                                    guidance["guidance_scale"], rank, num_ranks, guide=guidance["guide"],
                                    guidance_interval=guidance["guidance_interval"], vae=getattr(pipeline, "vae", None))
    if metrics is None:  # not rank 0
        return {}
    balance = {"num_classes": num_classes} if num_classes else {}
    if num_classes or guidance["guide"] is not None:
        balance.update(guidance_scale=guidance["guidance_scale"], guidance_interval=guidance["guidance_interval"],
                       autoguidance=guidance["guide"] is not None)
    return {**metrics, **balance, "feature_extractors": {m: e.name for e, _, group in suites for m in group},
            "reference_images": suites[0][1].num_images, "scheduler": sampler,
            "timestep_spacing": scheduler.config.get("timestep_spacing"),  # a flow scheduler has none
            "num_inference_steps": args.num_inference_steps}


def conditioned_metrics(args, pipeline, groups: dict, resolution: Resolution, device, rank: int, num_ranks: int,
                        guidance: dict) -> dict:
    """An image-conditioned pipeline's scores of the conditions of the --reference images (the
    module docstring); every rank samples its batches, rank 0 scores (the others get {})."""
    from diffusion_extras.cli.common import load_reference
    from diffusion_extras.evaluation import conditioned
    from diffusion_extras.evaluation.choices import DEFAULT_NOISE_LEVEL
    from diffusion_extras.evaluation.metrics import build_feature_extractor, check_suites, extract_all, score
    from diffusion_extras.evaluation.sampling import default_scheduler, make_scheduler

    kind = pipeline.config.conditioning
    inputs = reference_conditions(args, pipeline, resolution)
    sampler = args.scheduler or default_scheduler(pipeline.scheduler.config)
    pipeline.scheduler = make_scheduler(sampler, pipeline.scheduler.config, args.timestep_spacing)
    pipeline.set_progress_bar_config(disable=True)
    samples = conditioned.conditioned_samples(pipeline, inputs, args.num_inference_steps, args.seed,
                                              guidance["guidance_scale"], args.batch_size, rank, num_ranks,
                                              guidance["guidance_interval"], args.back_projection_steps,
                                              args.noise_level)
    if samples is None:  # not rank 0
        return {}
    targets = conditioned.to_uint8(inputs["images"])
    report = {"conditioning": kind, **conditioned.scores(kind, samples, targets, pipeline.config.sr_factor,
                                                         args.back_projection_steps)}
    if kind == "super_resolution":
        report["back_projection_steps"] = args.back_projection_steps
        if pipeline.config.get("max_noise_level"):  # the level the inputs were given at
            report["noise_level"] = DEFAULT_NOISE_LEVEL if args.noise_level is None else args.noise_level
    for features, wanted in groups.items():
        extractor = build_feature_extractor(features, args.inception_weights, device,
                                            model={"dinov2": args.dinov2_model, "clip": args.clip_model}.get(features))
        reference = load_reference(args.reference, extractor, resolution, args.cache_dir, args.batch_size)
        check_suites([(extractor, reference, wanted)])
        report.update(score(extract_all([samples], extractor), reference, wanted, args.seed))
        report.setdefault("feature_extractors", {}).update(dict.fromkeys(wanted, extractor.name))
    if args.baseline is not None and kind == "inpainting":
        report.update(baseline_scores(args, device, inputs, targets))
    return {**report, "num_samples": len(samples), "guidance_scale": guidance["guidance_scale"],
            "scheduler": sampler, "timestep_spacing": pipeline.scheduler.config.get("timestep_spacing"),
            "num_inference_steps": args.num_inference_steps}


def reference_conditions(args, pipeline, resolution: Resolution) -> dict:
    """The pipeline's inputs for the first --num_samples --reference images (training.conditioning
    conditions_of: "images" the targets, "image", "mask_image"), their masks from --masks or --mask,
    an image-to-image pipeline's conditions from --conditioning_images."""
    import numpy as np

    from diffusion_extras.cli.common import condition_masks, list_images, load_image, paired_paths
    from diffusion_extras.training.conditioning import ImageCondition, conditions_of

    kind, channels = pipeline.config.conditioning, pipeline.image_channels
    paths = list_images(args.reference)[:args.num_samples]
    background = pipeline.background  # the run's --background, as the trainer read its images
    stored = [np.stack([load_image(path, resolution, channels, background) for path in paths])]
    if kind == "inpainting":
        masks = condition_masks(args, paths, args.reference, stored[0].shape[1:3])
        stored.append((masks.permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8))
    elif kind == "image":
        pairs = paired_paths(paths, args.reference, args.conditioning_images, "--conditioning_images")
        stored.append(np.stack([load_image(path, resolution, channels, background) for path in pairs]))
    stored = np.concatenate(stored, axis=-1).transpose(0, 3, 1, 2)
    condition = ImageCondition(kind, channels, stored.shape[1] - channels, pipeline.config.sr_factor, args.seed)
    return {name: value for name, value in conditions_of(condition, stored, args.seed).items() if name != "shown"}


def baseline_scores(args, device, inputs: dict, targets) -> dict:
    """--baseline's scores (baseline_psnr, baseline_ssim, baseline_digit_accuracy): an unconditional
    pipeline's completions of the same images and masks, by the replacement method."""
    import numpy as np

    from diffusion_extras.cli.common import load_pipeline
    from diffusion_extras.evaluation import conditioned
    from diffusion_extras.evaluation.sampling import make_scheduler

    baseline = load_pipeline(args.baseline, device=device)
    channels = inputs["images"].shape[1]
    if getattr(baseline, "vae", None) is not None or baseline.unet.config.in_channels != channels:
        raise ValueError(f"--baseline {args.baseline}: give an unconditional pixel pipeline of {channels}-channel "
                         f"images (its UNet takes {baseline.unet.config.in_channels} channel(s))")
    scheduler = make_scheduler(args.scheduler, baseline.scheduler.config, args.timestep_spacing)
    count = len(targets)
    completions = np.concatenate([conditioned.inpaint_by_replacement(
        baseline.unet, scheduler, inputs["images"][first:first + args.batch_size] * 2 - 1,
        inputs["mask_image"][first:first + args.batch_size], args.num_inference_steps,
        range(first, min(first + args.batch_size, count)), args.seed) for first in range(0, count, args.batch_size)])
    values = conditioned.scores("inpainting", completions, targets)
    return {f"baseline_{name}": value for name, value in values.items() if not name.startswith("reference_")}
