"""Helpers the command lines share (`python -m diffusion_extras.sample`, `.evaluate`, `.posthoc_ema`)
once their flags are parsed (the flags themselves: arguments.py): the --device, loading a saved
pipeline (a local folder or a Hub id), loading reference images or statistics for the metrics.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch
from PIL import Image

from diffusion_extras.cli.inputs import (
    check_reference,
    local_pipeline_folder,
    package_pipeline_class,
    refuse_guidance_flags,
)
from diffusion_extras.data.images import preprocess_image
from diffusion_extras.evaluation.choices import LATENT_PIPELINE_CLASS, PIPELINE_CLASS
from diffusion_extras.evaluation.metrics import ReferenceStatistics, reference_statistics
from diffusion_extras.evaluation.pipeline_class_conditional import DEFAULT_GUIDANCE_SCALE, ClassConditionalPipeline
from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline, vae_scale_factor

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


# ----------------------------------------------------------------------------- the device
def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; a clear error when cuda is asked for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None


# ----------------------------------------------------------------------------- pipelines
def _is_offline_error(error: BaseException) -> bool:
    """True when loading failed for want of a network (offline mode, DNS, refused, timeout)."""
    while error is not None:
        name = type(error).__name__
        if isinstance(error, (ConnectionError, TimeoutError)) or name in (
                "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "gaierror", "LocalEntryNotFoundError"):
            return True
        error = error.__cause__ or error.__context__
    return False


def _load_from_hub(repo_id: str, dtype):
    from diffusers import DDPMPipeline
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its "Couldn't connect" warning would repeat our error
    try:
        return DDPMPipeline.from_pretrained(repo_id, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - hub failures come as OSError, HTTP or value errors
        if _is_offline_error(error):
            raise ValueError(f"{repo_id!r} is not a local folder and the Hub is offline (nor is it in "
                             "the local Hub cache); pass the folder that train_ddpm.py saved") from None
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{repo_id!r} is not a local folder and could not be loaded from the Hub: "
                         f"{first_line}") from None
    finally:
        diffusers_logging.set_verbosity(verbosity)


def load_pipeline(name_or_path: str, device="cpu", dtype=torch.float32):
    """A DDPMPipeline from a local save_pretrained folder or a Hub id, moved to `device`; a folder
    the trainer exported with a custom pipeline (class-conditional, latent) as that class."""
    from diffusers import DDPMPipeline, UNet2DModel

    path = local_pipeline_folder(name_or_path)
    if path is not None:
        pipeline_class = {PIPELINE_CLASS: ClassConditionalPipeline, LATENT_PIPELINE_CLASS: LatentDiffusionPipeline}.get(
            package_pipeline_class(path), DDPMPipeline)
        try:
            # the package's own copy of the class loads a custom pipeline's folder without running its code
            pipeline = pipeline_class.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as error:
            raise ValueError(f"could not load the pipeline in {path}: "
                             f"{str(error).strip().splitlines()[0]}") from None
    else:
        pipeline = _load_from_hub(name_or_path, dtype)
        if not isinstance(pipeline.unet, UNet2DModel):
            raise ValueError(f"{name_or_path} has a {type(pipeline.unet).__name__}; expected a UNet2DModel")
    return pipeline.to(device)


def load_guide(path: str, unet, device):
    """The guide UNet of --guide, in `unet`'s dtype: a UNet2DModel folder, a pipeline folder's unet/,
    or a training checkpoint (accelerate's model.safetensors: the raw, non-EMA weights of that step,
    with `unet`'s architecture)."""
    from diffusers import UNet2DModel
    from safetensors.torch import load_file
    folder = os.path.expanduser(path)
    if os.path.isfile(os.path.join(folder, "model.safetensors")) and not os.path.isfile(
            os.path.join(folder, "config.json")):
        guide = UNet2DModel.from_config(unet.config)
        guide.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
        return guide.to(device=device, dtype=unet.dtype)
    if os.path.isdir(os.path.join(folder, "unet")):
        folder = os.path.join(folder, "unet")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"--guide {path}: no UNet there; give a UNet folder, a pipeline folder with unet/ or a "
                         "training checkpoint folder (model.safetensors)")
    return UNet2DModel.from_pretrained(folder, torch_dtype=unet.dtype).to(device)


def guidance_for(pipeline, args, device, **class_flags) -> dict:
    """{guidance_scale, guide, guidance_interval} for sampling.generate from --guidance_scale (default
    DEFAULT_GUIDANCE_SCALE; 1: none), --guidance_interval and --guide; a ValueError when a guidance flag,
    or one of `class_flags` ({"--flag": value}), is given to an unconditional pipeline without a guide."""
    guide = getattr(pipeline, "guide", None)
    if args.guide is not None:
        guide = None if args.guide == "none" else load_guide(args.guide, pipeline.unet, device)
    if getattr(pipeline, "id2label", None) or guide is not None:
        scale = DEFAULT_GUIDANCE_SCALE if args.guidance_scale is None else args.guidance_scale
        return {"guidance_scale": scale, "guide": guide, "guidance_interval": args.guidance_interval}
    refuse_guidance_flags(type(pipeline).__name__, args, **class_flags)
    return {"guidance_scale": 1.0, "guide": None, "guidance_interval": None}


def pipeline_resolution(pipeline) -> int:
    """The side that images are generated at, and reference images resized to: the UNet's, or a
    latent pipeline's decoded side (the latents' times the VAE's factor)."""
    size = pipeline.unet.config.sample_size
    size = size if isinstance(size, int) else size[0]
    vae = getattr(pipeline, "vae", None)
    return size if vae is None else size * vae_scale_factor(vae.config)


# ----------------------------------------------------------------------------- reference images
def list_images(folder: str) -> list[str]:
    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(folder)
                   for name in names if name.lower().endswith(IMAGE_EXTENSIONS))
    if not paths:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {folder}")
    return paths


def load_image(path: str, resolution: int, channels: int = 3) -> np.ndarray:
    """uint8 [H, W, channels] (RGB by default), preprocessed exactly as training images are
    (shorter side to `resolution`, centre crop)."""
    with Image.open(path) as image:
        return preprocess_image(image, resolution, center_crop=True, channels=channels)


def load_images(folder: str, resolution: int, channels: int) -> np.ndarray:
    """uint8 [N, H, W, channels] of every image in `folder`, preprocessed as training images are
    (the bound scores the images themselves, so statistics files cannot serve)."""
    if not os.path.isdir(folder):
        raise ValueError(f"--reference {folder}: nll scores images, so give a folder of them (not statistics)")
    return np.stack([load_image(path, resolution, channels) for path in list_images(folder)])


def iter_image_batches(paths: list[str], resolution: int, batch_size: int):
    for first in range(0, len(paths), batch_size):
        yield np.stack([load_image(path, resolution) for path in paths[first:first + batch_size]])


def folder_fingerprint(paths: list[str], resolution: int) -> str:
    """Changes when a file is added, removed, rewritten or the resolution changes."""
    digest = hashlib.sha256(f"resolution={resolution}".encode())
    for path in paths:
        stat = os.stat(path)
        digest.update(f"\n{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def load_reference(reference: str, extractor, resolution: int, cache_dir: str | None, batch_size: int):
    """ReferenceStatistics from --reference: a statistics .npz made by the same extractor, or a folder
    of images (preprocessed like training images; its statistics cached in `cache_dir`)."""
    if os.path.isfile(reference):
        statistics = ReferenceStatistics.load(reference)
        if statistics.extractor_name != extractor.name:
            raise ValueError(f"{reference} was made with {statistics.extractor_name!r}, not {extractor.name!r}; "
                             "pass the matching --feature_extractor / --inception_weights or a folder of images")
        return statistics
    check_reference(reference)
    paths = list_images(reference)
    fingerprint = folder_fingerprint(paths, resolution)
    extractor_key = hashlib.sha256(extractor.name.encode()).hexdigest()[:8]
    cache_path = (os.path.join(cache_dir, f"reference-{fingerprint[:16]}-{extractor_key}.npz")
                  if cache_dir else None)
    return reference_statistics(iter_image_batches(paths, resolution, batch_size), extractor,
                                cache_path=cache_path, fingerprint=fingerprint)
