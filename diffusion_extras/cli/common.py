"""Helpers the command lines share (`python -m diffusion_extras.sample`, `.evaluate`, `.posthoc_ema`)
once their flags are parsed (the flags themselves: arguments.py): the --device, loading a saved
pipeline (a local folder or a Hub id), loading reference images or statistics for the metrics.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys

import numpy as np
import torch
from PIL import Image

from diffusion_extras.cli.inputs import (
    check_pipeline_folder,
    check_reference,
    local_pipeline_folder,
    package_pipeline_class,
    refuse_guidance_flags,
)
from diffusion_extras.data.images import BACKGROUNDS, PixelFormat, preprocess_image
from diffusion_extras.data.spec import Resolution, as_resolution, image_size
from diffusion_extras.evaluation.choices import (
    DEFAULT_IMAGE_GUIDANCE_SCALE,
    DIT_PIPELINE_CLASS,
    IMAGE_PIPELINE_CLASS,
    LATENT_PIPELINE_CLASS,
    PIPELINE_CLASS,
)
from diffusion_extras.evaluation.metrics import ReferenceStatistics, reference_statistics
from diffusion_extras.evaluation.pipeline_backbone import BACKBONES, backbone_named, pipeline_model
from diffusion_extras.evaluation.pipeline_class_conditional import (
    DEFAULT_GUIDANCE_SCALE,
    ClassConditionalPipeline,
    LabelledPipeline,
    check_guide,
)
from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline
from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline, vae_scale_factor
from diffusion_extras.hub.download import first_line, is_offline_error, offline_reason


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
def _pipeline_class(folder: str):
    """The class a checked pipeline folder loads as: the package's own pipeline class for the
    trainer's class-conditional, latent, image-conditioned or DiT export (its model_index.json names
    the saved copy of that file, which diffusers would refuse to run without trust_remote_code; the
    class is already at hand here), else DDPMPipeline."""
    from diffusers import DDPMPipeline

    return {PIPELINE_CLASS: ClassConditionalPipeline, LATENT_PIPELINE_CLASS: LatentDiffusionPipeline,
            IMAGE_PIPELINE_CLASS: ImageConditionedPipeline,
            DIT_PIPELINE_CLASS: DiTClassPipeline}.get(package_pipeline_class(folder), DDPMPipeline)


def _load_from_hub(repo_id: str, dtype):
    """A Hub id (the Hub cache and HF_ENDPOINT honoured): its model_index.json is read and checked
    as a folder's is, then the pipeline loads through the class it names."""
    from huggingface_hub import hf_hub_download

    with _hub_errors(repo_id):
        index_folder = os.path.dirname(hf_hub_download(repo_id, "model_index.json"))
    check_pipeline_folder(index_folder)
    with _hub_errors(repo_id):
        return _pipeline_class(index_folder).from_pretrained(repo_id, dtype=dtype)


@contextlib.contextmanager
def _hub_errors(repo_id: str):
    """A failed download as one ValueError: HF_HUB_OFFLINE or an unreachable Hub named, else the
    library's first line."""
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its "Couldn't connect" warning would repeat our error
    try:
        yield
    except Exception as error:  # noqa: BLE001 - hub failures come as OSError, HTTP or value errors
        if is_offline_error(error):
            raise ValueError(f"{repo_id!r} is not a local folder and cannot be downloaded: "
                             f"{offline_reason(repo_id)}") from None
        raise ValueError(f"{repo_id!r} is not a local folder and could not be loaded from the Hub: "
                         f"{first_line(error)}") from None
    finally:
        diffusers_logging.set_verbosity(verbosity)


def load_pipeline(name_or_path: str, device="cpu", dtype=torch.float32):
    """A DDPMPipeline, or one of the trainer's custom pipelines (class-conditional, latent,
    image-conditioned, DiT), from a local save_pretrained folder or a Hub id, moved to `device`."""
    path = local_pipeline_folder(name_or_path)
    if path is not None:
        try:
            pipeline = _pipeline_class(path).from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as error:
            raise ValueError(f"could not load the pipeline in {path}: "
                             f"{str(error).strip().splitlines()[0]}") from None
    else:
        pipeline = _load_from_hub(name_or_path, dtype)
        model = pipeline_model(pipeline)
        if not isinstance(model, tuple(backbone.model_class for backbone in BACKBONES)):
            raise ValueError(f"{name_or_path} has a {type(model).__name__}; expected a "
                             f"{' or '.join(backbone.model_class.__name__ for backbone in BACKBONES)}")
    return pipeline.to(device)


def load_guide(path: str, unet, device, prediction_type: str | None = None):
    """The guide model of --guide (a UNet2DModel or a DiT), in `unet`'s dtype, checked against `unet`
    (the pipeline's model; check_guide) and, where its folder records one, against the model's
    `prediction_type`: a pipeline folder (its unet/ or transformer/, its scheduler's prediction
    type), a model folder (the prediction type of the pipeline around it, if any) or a training
    checkpoint (its EMA weights where the run kept an EMA, as the exported pipeline and Karras et
    al.'s guides; else the raw weights of that step; stderr says which)."""
    from diffusion_extras.training.checkpointing import TRAIN_STATE, checkpoint_model, read_train_state
    folder = os.path.expanduser(path)
    if os.path.isfile(os.path.join(folder, TRAIN_STATE)):
        guide, weights = checkpoint_model(folder)
        print(f"--guide {path}: the checkpoint's {weights} weights"
              + ("" if weights == "EMA" else " (the run kept no EMA)"), file=sys.stderr)
        guide_prediction_type = read_train_state(folder)["config"].get("prediction_type")
    else:
        folder = next((os.path.join(folder, backbone.component) for backbone in BACKBONES
                       if os.path.isdir(os.path.join(folder, backbone.component))), folder)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"--guide {path}: no model there; give a UNet or DiT folder, a pipeline folder with "
                             "unet/ or transformer/, or a training checkpoint folder (checkpoint-N)")
        with open(os.path.join(folder, "config.json")) as fh:
            kind = json.load(fh).get("_class_name")
        # a config without _class_name: a UNet's, as before
        guide = backbone_named(class_name=kind).model_class.from_pretrained(folder)
        scheduler_config = os.path.join(os.path.dirname(os.path.normpath(folder)), "scheduler", "scheduler_config.json")
        guide_prediction_type = None
        if os.path.isfile(scheduler_config):
            with open(scheduler_config) as fh:
                guide_prediction_type = json.load(fh).get("prediction_type", "epsilon")  # diffusers' default
    try:
        check_guide(unet, guide)
    except ValueError as error:
        raise ValueError(f"--guide {path}: {error}") from None
    if None not in (prediction_type, guide_prediction_type) and prediction_type != guide_prediction_type:
        raise ValueError(f"--guide {path}: it predicts {guide_prediction_type} and the model {prediction_type}; "
                         "a guide must predict the same quantity")
    return guide.to(device=device, dtype=unet.dtype)


def guidance_for(pipeline, args, device, **class_flags) -> dict:
    """{guidance_scale, guide, guidance_interval} for sampling.generate from --guidance_scale (default
    DEFAULT_GUIDANCE_SCALE; 1: none), --guidance_interval and --guide; a ValueError when a guidance flag,
    or one of `class_flags` ({"--flag": value}), is given to an unconditional pipeline without a guide."""
    if isinstance(pipeline, ImageConditionedPipeline):  # guidance on the image: the dropped condition is the weak one
        if args.guide not in (None, "none"):
            raise ValueError("--guide: an image-conditioned pipeline guides on its image (the prediction without "
                             "the condition), not with a guide UNet; drop --guide")
        scale = DEFAULT_IMAGE_GUIDANCE_SCALE if args.guidance_scale is None else args.guidance_scale
        pipeline.check_guidance(scale)  # refused where the export records no condition dropout
        return {"guidance_scale": scale, "guide": None, "guidance_interval": args.guidance_interval}
    guide = getattr(pipeline, "guide", None)
    if args.guide is not None:
        guide = (None if args.guide == "none" else
                 load_guide(args.guide, pipeline_model(pipeline), device,
                            pipeline.scheduler.config.get("prediction_type")))
    if getattr(pipeline, "id2label", None) or guide is not None:
        scale = DEFAULT_GUIDANCE_SCALE if args.guidance_scale is None else args.guidance_scale
        if isinstance(pipeline, LabelledPipeline):  # the latent and DiT ones too
            pipeline.check_guidance(scale, guide)
        return {"guidance_scale": scale, "guide": guide, "guidance_interval": args.guidance_interval}
    refuse_guidance_flags(type(pipeline).__name__, args, **class_flags)
    return {"guidance_scale": 1.0, "guide": None, "guidance_interval": None}


def pipeline_resolution(pipeline) -> Resolution:
    """The size that images are generated at, and reference images resized to (N, or (height,
    width)): the UNet's sample_size, or a latent pipeline's decoded size (the latents' times the
    VAE's factor)."""
    vae = getattr(pipeline, "vae", None)
    factor = 1 if vae is None else vae_scale_factor(vae.config)
    return as_resolution([side * factor for side in image_size(pipeline_model(pipeline).config.sample_size)])


# ----------------------------------------------------------------------------- condition images
def read_images(paths: list[str], channels: int, background: tuple = BACKGROUNDS["white"]) -> np.ndarray:
    """uint8 [N, H, W, channels] of image files as they are (no resizing: a super-resolution input
    keeps its size), converted to grayscale or RGB as the trainer converts (transparency composited
    on `background`, the run's --background); one size for all, or a one-line ValueError."""
    from diffusion_extras.data.images import decode_image

    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(decode_image({"path": path, "bytes": None}, (image.height, image.width), True, channels,
                                       PixelFormat("uint8", background)))
    sizes = sorted({image.shape[:2] for image in images})
    if len(sizes) > 1:
        raise ValueError(f"the images ({paths[0]}, ...) are of {len(sizes)} sizes ({sizes[0]}, {sizes[1]}, ...; "
                         "height, width): give images of one size, or sample each size apart")
    return np.stack(images)


def paired_paths(paths: list[str], folder: str, other: str, flag: str) -> list[str]:
    """For each image of `paths` (under `folder`), the one file of `other` at the same relative path
    (any image extension), or a one-line ValueError naming the first image without one, or two
    files of one name (data/pairs.py: the trainer's rule for its paired folders)."""
    from diffusion_extras.data.pairs import image_files

    pairs = image_files(other, flag)
    keys = [os.path.splitext(os.path.relpath(path, folder))[0] for path in paths]
    first = {}
    for key, path in zip(keys, paths):
        twin = first.setdefault(key, path)
        if twin != path:
            raise ValueError(f"{twin} and {path} have one name but for the extension, and {flag} pairs a file by its "
                             "name: keep one of them")
    missing = [path for path, key in zip(paths, keys) if key not in pairs]
    if missing:
        raise ValueError(f"{flag} {other}: no file at the relative path of {missing[0]} ({len(missing)} image(s) "
                         "without one); give every image its pair")
    return [pairs[key] for key in keys]


def condition_masks(args, paths: list[str], folder: str, size) -> torch.Tensor:
    """float [N, 1, H, W] masks (1 = to fill) of the images `paths` (under `folder`, of (H, W) `size`):
    --masks' files at their relative paths (read by the mask rule at their image's stored size,
    data/conditioning.stored_mask, then resized and cropped to `size` as the image is), else
    --mask's half or random masks (random_mask, from --seed and the image's index)."""
    from diffusion_extras.cli.arguments import MASK_KINDS
    from diffusion_extras.data.batch_order import mix_seed
    from diffusion_extras.data.conditioning import half_mask, oriented_size, random_masks, stored_mask

    height, width = size
    if args.masks is not None:  # read as the trainer reads a stored mask beside its image (decode_pair)
        masks = []
        for image_path, path in zip(paths, paired_paths(paths, folder, args.masks, "--masks")):
            with Image.open(path) as mask:
                binary = stored_mask(mask, oriented_size({"path": image_path, "bytes": None}), path)
            masks.append(preprocess_image(binary, (height, width), center_crop=True, channels=1)[:, :, 0])
        return torch.from_numpy(np.stack(masks)[:, None] > 127).float()  # binarised at half, as the trainer's step
    if args.mask not in (None, MASK_KINDS[0]):  # None: not given, random
        return torch.from_numpy(half_mask(height, width, args.mask)).float().expand(len(paths), 1, height, width)
    return torch.from_numpy(random_masks(height, width, [mix_seed(args.seed, index) for index in range(len(paths))]))


def unit_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, C] -> float [N, C, H, W] in [0, 1], as diffusers' image processor takes tensors."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


# ----------------------------------------------------------------------------- reference images
def list_images(folder: str) -> list[str]:
    """The image files under `folder` (the extensions the trainer reads: data/pairs.py), sorted by path."""
    from diffusion_extras.data.pairs import is_image_file

    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                   if is_image_file(name))
    if not paths:
        raise ValueError(f"no images found under {folder} (the extensions datasets' imagefolder reads: .png, .jpg, "
                         ".webp, .tif, ...)")
    return paths


def load_image(path: str, resolution: Resolution, channels: int = 3,
               background: tuple = BACKGROUNDS["white"]) -> np.ndarray:
    """uint8 [H, W, channels] (RGB by default), preprocessed exactly as training images are
    (resized to cover `resolution` keeping the aspect, centre crop; transparency on `background`)."""
    with Image.open(path) as image:
        return preprocess_image(image, resolution, center_crop=True, channels=channels,
                                pixels=PixelFormat("uint8", background))


def load_images(folder: str, resolution: Resolution, channels: int) -> np.ndarray:
    """uint8 [N, H, W, channels] of every image in `folder`, preprocessed as training images are
    (the bound scores the images themselves, so statistics files cannot serve)."""
    if not os.path.isdir(folder):
        raise ValueError(f"--reference {folder}: nll scores images, so give a folder of them (not statistics)")
    return np.stack([load_image(path, resolution, channels) for path in list_images(folder)])


def iter_image_batches(paths: list[str], resolution: Resolution, batch_size: int):
    for first in range(0, len(paths), batch_size):
        yield np.stack([load_image(path, resolution) for path in paths[first:first + batch_size]])


def folder_fingerprint(paths: list[str], resolution: Resolution) -> str:
    """Changes when a file is added, removed, rewritten or the resolution changes."""
    digest = hashlib.sha256(f"resolution={resolution}".encode())
    for path in paths:
        stat = os.stat(path)
        digest.update(f"\n{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def load_reference(reference: str, extractor, resolution: Resolution, cache_dir: str | None, batch_size: int):
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
