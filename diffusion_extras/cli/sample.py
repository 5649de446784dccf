"""Command line: sample images from a saved DDPMPipeline, class-conditional, latent or
image-conditioned pipeline folder.

    python -m diffusion_extras.sample PIPELINE --num_images 16 --scheduler ddim --output DIR
    python -m diffusion_extras.sample PIPELINE --class_labels 3,7 --guidance_scale 2 --output DIR
    python -m diffusion_extras.sample PIPELINE --guide EARLIER_PIPELINE --guidance_interval 0.3,5 --output DIR
    python -m diffusion_extras.sample SR_PIPELINE --conditioning_images LOW_RES_DIR --output DIR
    python -m diffusion_extras.sample INPAINTING_PIPELINE --conditioning_images DIR --masks DIR --output DIR

An image-conditioned pipeline samples one image per file of --conditioning_images (in sorted path
order: 000000.png is the first): a super-resolution pipeline's low-resolution inputs, an inpainting
pipeline's images (their masks: --masks, the files at the same relative paths, white = to fill;
else --mask, a half or random masks), an image-to-image pipeline's conditioning images.
"""
from __future__ import annotations

import argparse

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
    pipeline_conditioning,
    saved_conditioning,
    saved_id2label,
)
from diffusion_extras.core.commands import importing_the_stack, leaves_the_process_as_found
from diffusion_extras.evaluation.choices import SAMPLING_DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = pipeline_parser("sample", __doc__)
    parser.add_argument("--num_images", type=positive_int, default=None,
                        help="images to sample (default: 16); with --conditioning_images, one per conditioning "
                             "image, at most this many (default there: all of them)")
    add_sampler_arguments(parser)
    parser.add_argument("--batch_size", type=positive_int, default=16,
                        help="images per UNet call (default: %(default)s)")
    parser.add_argument("--output", required=True, help="folder for 000000.png ... and grid.png")
    parser.add_argument("--class_labels", default=None,
                        help="class-conditional pipelines: comma list of class ids or names (image i is of "
                             "class i mod the list's length); default: every class in turn")
    add_condition_arguments(parser, "folder of the images whose conditions are sampled (image-conditioned "
                                    "pipelines): low-resolution inputs, images to inpaint or conditioning images")
    add_guidance_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=SAMPLING_DTYPES, default="fp32",
                        help="UNet precision; the sampler state stays fp32 (default: %(default)s)")
    return parser


@leaves_the_process_as_found
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_errors():  # a missing folder, a misplaced flag or an unknown class answers at once too
        folder = check_pipeline_argument(args, **{"--class_labels": args.class_labels})
        if folder is not None:
            requested_classes(saved_id2label(folder), args.class_labels, args.num_images or 16)
            check_conditioning_flags(saved_conditioning(folder), args)
    # torch and diffusers (seconds) once the flags and the folder are good
    with importing_the_stack():
        from diffusion_extras.cli.common import guidance_for, load_pipeline, resolve_device
        from diffusion_extras.evaluation.pipeline_backbone import pipeline_model
        from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline
        from diffusion_extras.evaluation.sampling import DTYPES, generate, make_scheduler, save_images

    dtype = DTYPES[args.dtype]
    with one_line_errors():
        device = resolve_device(args.device)
        pipeline = load_pipeline(args.pipeline, device=device, dtype=dtype)
        check_loaded_pipeline_flags(pipeline, args)  # a Hub id's, known once it is loaded
        guidance = guidance_for(pipeline, args, device, **{"--class_labels": args.class_labels})
        scheduler = make_scheduler(args.scheduler, pipeline.scheduler.config, args.timestep_spacing)
        if isinstance(pipeline, ImageConditionedPipeline):
            images = sample_conditions(args, pipeline, scheduler, guidance)
        else:
            num_images = args.num_images or 16
            labels = requested_classes(getattr(pipeline, "id2label", None), args.class_labels, num_images)
            images = generate(pipeline_model(pipeline), scheduler, num_images, args.num_inference_steps,
                              seed=args.seed, batch_size=args.batch_size, device=device,
                              dtype=dtype, progress=True, class_labels=labels, vae=getattr(pipeline, "vae", None),
                              **guidance)
        paths = save_images(images, args.output)
    print(f"wrote {len(images)} images and {paths[-1]}")
    return 0


def sample_conditions(args, pipeline, scheduler, guidance: dict):
    """uint8 [N, H, W, C]: an image-conditioned pipeline's samples of the images of
    --conditioning_images (with their masks), image i with noise from (--seed, i)."""
    import numpy as np

    from diffusion_extras.cli.common import condition_masks, list_images, read_images, unit_tensor
    from diffusion_extras.evaluation.conditioned import batch, sample_conditioned

    kind = pipeline.config.conditioning
    paths = list_images(args.conditioning_images)[:args.num_images]
    inputs = {"image": unit_tensor(read_images(paths, pipeline.image_channels, pipeline.background))}
    if kind == "inpainting":
        inputs["mask_image"] = condition_masks(args, paths, args.conditioning_images, inputs["image"].shape[-2:])
    pipeline.scheduler = scheduler
    pipeline.set_progress_bar_config(disable=True)
    return np.concatenate([sample_conditioned(pipeline, batch(inputs, first, args.batch_size),
                                              range(first, min(first + args.batch_size, len(paths))),
                                              args.num_inference_steps, args.seed, guidance["guidance_scale"],
                                              guidance["guidance_interval"], args.back_projection_steps,
                                              args.noise_level)
                           for first in range(0, len(paths), args.batch_size)])


def check_loaded_pipeline_flags(pipeline, args) -> None:
    """The flags that mean nothing for the loaded pipeline's kind, refused in one line: the condition
    flags (check_conditioning_flags) and --class_labels on a pipeline without classes. A local
    folder was checked before loading (main); a Hub id is known only now."""
    check_conditioning_flags(pipeline_conditioning(pipeline), args)
    if args.class_labels is not None and not getattr(pipeline, "id2label", None):
        raise ValueError(f"--class_labels: this pipeline ({type(pipeline).__name__}) has no classes: drop it")


def requested_classes(id2label: dict[int, str] | None, class_labels: str | None,
                      num_images: int) -> list[int] | None:
    """A class id per image (None for an unconditional pipeline: no `id2label`, the pipeline's
    classes) from --class_labels (ids or names); a ValueError for an unknown class."""
    if not id2label:
        return None
    ids = list(id2label)
    if class_labels is not None:
        labels = {name: index for index, name in sorted(id2label.items())}  # as the pipeline's .labels
        ids = []
        for item in (part.strip() for part in class_labels.split(",") if part.strip()):
            if item in labels:
                ids.append(labels[item])
            elif item.lstrip("-").isdigit() and int(item) in id2label:
                ids.append(int(item))
            else:
                raise ValueError(f"--class_labels: unknown class {item!r}; the classes are "
                                 + ", ".join(f"{i} ({name})" for i, name in id2label.items()))
        if not ids:
            raise ValueError("--class_labels: give at least one class id or name")
    return [ids[i % len(ids)] for i in range(num_images)]
