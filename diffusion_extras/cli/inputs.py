"""The files the sample and evaluate commands read, checked before torch and diffusers load
(seconds): a PIPELINE argument that is neither a pipeline folder nor a Hub id, guidance flags given to
an unconditional pipeline folder (read from its model_index.json alone), and a --reference that is
not there; the class names a class-conditional folder records (saved_id2label), for the sample
command's --class_labels. cli/common.py asks the same functions again as it loads them, for its
library callers."""
from __future__ import annotations

import json
import os

from diffusion_extras.evaluation.choices import (
    DIT_PIPELINE_CLASS,
    IMAGE_PIPELINE_CLASS,
    LATENT_PIPELINE_CLASS,
    PIPELINE_CLASS,
)
from diffusion_extras.hub.download import local_folder

# the trainer's custom pipelines
PACKAGE_PIPELINES = (PIPELINE_CLASS, LATENT_PIPELINE_CLASS, IMAGE_PIPELINE_CLASS, DIT_PIPELINE_CLASS)
# the denoising model's component in model_index.json: a DiT pipeline's transformer, every other one's unet
MODEL_COMPONENTS = {"transformer": "DiTTransformer2DModel", "unet": "UNet2DModel"}
UNCONDITIONAL = "DDPMPipeline"  # the class an unconditional folder loads as (load_pipeline)


def read_model_index(path: str) -> dict:
    with open(os.path.join(path, "model_index.json")) as f:
        return json.load(f)


def check_pipeline_folder(path: str) -> None:
    """A one-line ValueError unless `path` holds an unconditional DDPMPipeline or one of the trainer's
    pipelines around its model (read from model_index.json, without loading any weights)."""
    index_path = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"{path} is not a diffusers pipeline folder (no model_index.json); pass the "
                         "output_dir that train_ddpm.py saved, or a folder written by save_pretrained")
    try:
        index = read_model_index(path)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{index_path} is not readable JSON ({error})") from None
    if isinstance(index.get("_class_name"), list) and index["_class_name"][-1] not in PACKAGE_PIPELINES:
        raise ValueError(f"{path} holds a custom pipeline {index['_class_name']}; "
                         f"expected a DDPMPipeline, {', '.join(PACKAGE_PIPELINES)}")
    name = index.get("_class_name")
    component = "transformer" if isinstance(name, list) and name[-1] == DIT_PIPELINE_CLASS else "unet"
    model_class = (index.get(component) or [None, None])[-1]
    if model_class != MODEL_COMPONENTS[component] or "scheduler" not in index:
        raise ValueError(f"{path} holds a {index.get('_class_name', 'unknown')} with {component} {model_class}; "
                         f"expected an unconditional DDPMPipeline (UNet2DModel + scheduler)")


def saved_id2label(path: str) -> dict[int, str]:
    """The class names of a checked pipeline folder, {id: name}, as its model_index.json records
    them for ClassConditionalPipeline.from_pretrained ({} for a DDPMPipeline or one without classes)."""
    return {int(index): str(name) for index, name in (read_model_index(path).get("id2label") or {}).items()}


def saved_conditioning(path: str) -> dict | None:
    """{"conditioning": kind (super_resolution, inpainting, image), "max_noise_level": n} of a
    checked pipeline folder's image-conditioned pipeline, or None for any other."""
    if package_pipeline_class(path) != IMAGE_PIPELINE_CLASS:
        return None
    return _conditioning(read_model_index(path))


def _conditioning(config) -> dict:
    return {"conditioning": config.get("conditioning"), "max_noise_level": int(config.get("max_noise_level") or 0)}


def check_conditioning_flags(saved: dict | None, args,
                             needs_images: tuple = ("super_resolution", "inpainting", "image")) -> None:
    """The sample and evaluate commands' condition flags (`args`: --conditioning_images, --masks,
    --mask, --back_projection_steps, --noise_level, evaluate's --baseline) against the pipeline's
    condition (None: not image-conditioned; a folder's saved_conditioning, or a loaded pipeline's
    pipeline_conditioning): a one-line ValueError for a flag that means nothing for it, or for
    --conditioning_images missing where the kinds of `needs_images` take it (and given where they
    do not: evaluate makes the other kinds' conditions from --reference)."""
    conditioning = saved and saved["conditioning"]
    given = {flag: value for flag, value in (
        ("--conditioning_images", args.conditioning_images), ("--masks", args.masks), ("--mask", args.mask),
        ("--back_projection_steps", args.back_projection_steps), ("--baseline", getattr(args, "baseline", None)),
        ("--noise_level", args.noise_level is not None))
        if value}
    kinds = {"--masks": "inpainting", "--mask": "inpainting", "--baseline": "inpainting",
             "--back_projection_steps": "super_resolution", "--noise_level": "super_resolution"}
    names = {"inpainting": "inpainting", "super_resolution": "super-resolution"}
    for flag in given:
        if flag in kinds and conditioning != kinds[flag]:
            raise ValueError(f"{flag} is for {names[kinds[flag]]} pipelines; this pipeline's conditioning is "
                             f"{conditioning or 'none'}: drop it")
    if "--noise_level" in given and not 0 <= args.noise_level <= saved["max_noise_level"]:
        raise ValueError(f"--noise_level {args.noise_level}: " + (
            f"this pipeline takes levels 0 to {saved['max_noise_level']} (its --max_noise_level)"
            if saved["max_noise_level"] else
            "this pipeline was trained without conditioning augmentation (--max_noise_level): drop it"))
    if conditioning is None:
        if "--conditioning_images" in given:
            raise ValueError("--conditioning_images is for image-conditioned pipelines (super-resolution, inpainting, "
                             "image-to-image); this pipeline is not one: drop it")
        return
    if "--masks" in given and "--mask" in given:
        raise ValueError("--mask draws masks where no --masks are given: give one of them")
    if conditioning in needs_images and args.conditioning_images is None:
        raise ValueError(f"this pipeline is image-conditioned ({conditioning}): give --conditioning_images DIR")
    if conditioning not in needs_images and "--conditioning_images" in given:
        raise ValueError(f"--conditioning_images: this command makes a {conditioning} pipeline's conditions from "
                         "the --reference images: drop it")
    for flag in ("--conditioning_images", "--masks"):
        if flag in given and not os.path.isdir(given[flag]):
            raise ValueError(f"{flag} {given[flag]}: no such folder")


def pipeline_conditioning(pipeline) -> dict | None:
    """The condition of a loaded pipeline (an ImageConditionedPipeline's config records it), or None
    for any other: what saved_conditioning reads of a folder, for a Hub id once it is loaded."""
    config = dict(pipeline.config)
    return _conditioning(config) if config.get("conditioning") else None


def package_pipeline_class(path: str) -> str | None:
    """The class name of a checked pipeline folder's package pipeline (PACKAGE_PIPELINES), or None
    (a DDPMPipeline). model_index.json names its file and class, diffusers' custom-pipeline
    convention, or the class-conditional class alone (what its save_pretrained wrote before it
    named the file)."""
    name = read_model_index(path).get("_class_name")
    if isinstance(name, list):
        return name[-1]
    return name if name == PIPELINE_CLASS else None


def is_package_pipeline(path: str) -> bool:
    """A checked pipeline folder holds one of the package's pipelines (class-conditional, with a
    saved guide/, latent); otherwise it loads as a DDPMPipeline."""
    return package_pipeline_class(path) is not None


def local_pipeline_folder(name_or_path: str) -> str | None:
    """The checked pipeline folder that the PIPELINE argument names, or None for a Hub id; a
    one-line error for a file, or for a path that is not there and cannot be a Hub id."""
    path = local_folder(name_or_path, "pipeline folder")
    if path is not None:
        check_pipeline_folder(path)
    return path


def refuse_guidance_flags(pipeline_name: str, args, **class_flags) -> None:
    """The ValueError for the first guidance flag of `args`, or of the command's class flags
    (`class_flags`: {"--flag": value}), given to an unconditional pipeline (a `pipeline_name`) that
    has no guide."""
    flags = {"--guidance_scale": args.guidance_scale, "--guidance_interval": args.guidance_interval, **class_flags}
    for flag, value in flags.items():
        if value is not None:
            raise ValueError(f"{flag}: this pipeline is unconditional (a {pipeline_name}) and has no "
                             "--guide; drop the flag or give a --guide")


def check_reference(reference: str) -> None:
    """--reference names a statistics file or a folder of images."""
    if not os.path.isfile(reference) and not os.path.isdir(reference):
        raise FileNotFoundError(f"--reference {reference} is neither a folder of images nor a .npz statistics file")


def check_pipeline_argument(args, **class_flags) -> str | None:
    """The refusals of load_pipeline and guidance_for that need no weights: a PIPELINE argument that
    names nothing usable, and guidance or class flags (`class_flags`: {"--flag": value}) for an
    unconditional folder without --guide. (A Hub id is checked once it is downloaded.) Returns the
    checked local folder, or None for a Hub id."""
    path = local_pipeline_folder(args.pipeline)
    if path is not None and not is_package_pipeline(path) and args.guide in (None, "none"):
        refuse_guidance_flags(UNCONDITIONAL, args, **class_flags)
    return path
