"""How an inpainting mask is read, in every form users store one: the rule the exported inpainting
pipeline applies to its `mask_image` and the trainer to its stored masks (data/conditioning.py),
written once. It is copied into exported folders with pipeline_image_conditioned.py, which imports
it (and pipeline_images.py, whose RGB -> L it uses): numpy, torch, Pillow and diffusers only.

White (1) is to fill, black (0) to keep. Each mask's values are put on their scale, then binarised
at half of it by diffusers' mask processor (VaeImageProcessor(do_normalize=False, do_binarize=True,
do_convert_grayscale=True), as Stable Diffusion's inpainting pipeline reads its mask):

    booleans, Pillow's mode 1          True = to fill
    integers (8-bit, 16-bit, ints)     a mask holding only 0 and 1 is 0/1 (how segmentation masks are
                                       saved: read as 0/255 it would fill nothing); any other is on
                                       its storage's scale (0..255, 0..65535); Python ints: 0..255
    floats                             on [0, 1]; floats holding 8-bit levels (whole numbers up to 255)
                                       as those levels; others are refused
    RGB, colour palettes (P)           the grey they show (a palette's colours, not its indices), when
                                       the channels agree within an eighth of the range (JPEG's noise);
                                       a mask in colour (a label map's palette) is refused
    alpha (RGBA, LA, PA, tRNS)         an opaque alpha is dropped; transparency is refused: it may mean
                                       the area to fill (OpenAI's edit masks) or nothing (diffusers reads
                                       the colour and drops it)

A mask that marks pixels but reaches half nowhere (a label map of classes 0, 1, 2, ...; a faint
soft mask) would fill nothing: refused. An all-black mask is read as it is (nothing to fill).
Layouts are diffusers' (one mask or a batch: numpy [H, W], [B, H, W], [B, H, W, C]; torch [H, W],
[B, H, W], [B, C, H, W]) and a numpy [H, W, C] with C 2 to 4 is one mask with colour or alpha, as
np.asarray(Image.open(...)) makes it.
"""
from __future__ import annotations

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from .pipeline_images import LUMA  # the images' RGB -> L, written once

GREY_TOLERANCE = 1 / 8  # of the range: how far the channels of a grey mask may differ (compression noise)


def read_masks(mask, name: str = "mask_image") -> np.ndarray:
    """float32 [N, H, W] in [0, 1] of a mask or a batch of masks (a PIL image, a numpy array, a
    torch tensor, or a list of them), each on its scale (the module's rule), not yet binarised.
    A mask that cannot be read as meant is a ValueError naming `name` and the fix."""
    if isinstance(mask, (list, tuple)):
        masks = [read_masks(item, f"{name}[{index}]") for index, item in enumerate(mask)]
        if len({m.shape[1:] for m in masks}) > 1:
            raise ValueError(f"{name}: the masks are of several sizes; give masks of one size")
        return np.concatenate(masks)
    if isinstance(mask, Image.Image):
        samples, full_scale = _pil_samples(mask)
    elif isinstance(mask, (np.ndarray, torch.Tensor)):
        samples, full_scale = _array_samples(mask, name), None
    else:
        raise ValueError(f"{name} is a {type(mask).__name__}; give a PIL image, a numpy array or a torch tensor")
    return np.stack([_on_scale(plane, full_scale, name if len(samples) == 1 else f"{name}[{index}]")
                     for index, plane in enumerate(samples)])


def mask_processor() -> VaeImageProcessor:
    """diffusers' mask processor as its inpainting pipelines build it: no normalising, binarised at 0.5."""
    return VaeImageProcessor(vae_scale_factor=1, do_normalize=False, do_binarize=True, do_convert_grayscale=True)


def binary_masks(mask, size: tuple[int, int], name: str = "mask_image",
                 processor: VaeImageProcessor | None = None) -> torch.Tensor:
    """float32 [N, 1, height, width] of 0 and 1 (1 = to fill): read_masks, resized to `size`
    (height, width) where it is of another size but the same aspect (as diffusers' mask processor
    resizes a tensor: nearest neighbour; another aspect is refused, naming both sizes), binarised
    at 0.5 by that processor (`processor`: one built by mask_processor, which a pipeline keeps)."""
    values = torch.from_numpy(read_masks(mask, name))[:, None]
    check_mask_size(tuple(values.shape[-2:]), size, name)
    return (processor or mask_processor()).preprocess(values, height=size[0], width=size[1])


def check_mask_size(mask_size: tuple[int, int], image_size: tuple[int, int], name: str) -> None:
    """A mask of its image's aspect (each side, scaled as the other, within a pixel) is resized;
    one of another aspect would be stretched, so it is refused, naming both (height x width)."""
    (mask_height, mask_width), (height, width) = mask_size, image_size
    if abs(mask_height * width / mask_width - height) > 1 or abs(mask_width * height / mask_height - width) > 1:
        raise ValueError(f"{name} is {mask_height}x{mask_width} (height x width) and its image {height}x{width}: "
                         "another aspect ratio; give the mask of its image's size (or one of the same aspect)")


def _pil_samples(image: Image.Image) -> tuple[np.ndarray, float | None]:
    """([1, H, W, C] of the image's samples, their full scale or None (floats, booleans)): colour
    and palette images as the colours they show, with their alpha (a tRNS key made alpha)."""
    if image.mode == "1":
        return np.asarray(image, dtype=bool)[None, :, :, None], None
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return np.asarray(image).astype(np.int64)[None, :, :, None], 65535  # 16-bit (Pillow opens some as I)
    if image.mode == "F":
        return np.asarray(image, dtype=np.float32)[None, :, :, None], None
    has_alpha = image.mode in ("LA", "La", "PA", "RGBA", "RGBa") or "transparency" in image.info
    if image.mode in ("L", "LA", "La"):
        image = image.convert("LA" if has_alpha else "L")
    else:  # RGB(A), palettes, CMYK, YCbCr, ...: the colours shown
        image = image.convert("RGBA" if has_alpha else "RGB")
    samples = np.asarray(image)
    return (samples[:, :, None] if samples.ndim == 2 else samples)[None], 255


def _array_samples(mask, name: str) -> np.ndarray:
    """[N, H, W, C] of a numpy array or a torch tensor in diffusers' layouts (module docstring)."""
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu()
        mask = mask.float() if mask.is_floating_point() else mask
        if mask.ndim == 4:
            mask = mask.permute(0, 2, 3, 1)
        mask = mask.numpy()
    elif mask.ndim == 3 and mask.shape[-1] in (2, 3, 4):
        mask = mask[None]  # one [H, W, C] mask
    if mask.ndim == 2:
        mask = mask[None]
    if mask.ndim == 3:
        mask = mask[:, :, :, None] if mask.shape[-1] != 1 else mask[None]  # [B, H, W] / one [H, W, 1]
    if mask.ndim != 4 or mask.shape[-1] not in (1, 2, 3, 4):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; a mask is [H, W], [B, H, W] or with its channels "
                         "(1 to 4) last in numpy, second in torch")
    if mask.dtype.kind not in "biuf":
        raise ValueError(f"{name} holds {mask.dtype}; give booleans, integers or floats")
    return mask


def _on_scale(samples: np.ndarray, full_scale: float | None, name: str) -> np.ndarray:
    """float32 [H, W] in [0, 1] of one mask's samples [H, W, C] (the module's rule); `full_scale`:
    the storage's (a PIL mode's), else judged from the dtype."""
    if samples.dtype == bool:
        return samples[:, :, 0].astype(np.float32)
    if full_scale is None and samples.dtype.kind in "iu":  # uint8, uint16: their range; other ints: 8 or 16 bits
        full_scale = {np.dtype(np.uint8): 255, np.dtype(np.uint16): 65535}.get(
            samples.dtype, 255 if samples.max(initial=0) <= 255 else 65535)
    values = samples.astype(np.float64)
    if values.size and values.min() < 0:
        raise ValueError(f"{name} holds negative values (down to {values.min():g}); a mask is 0 (keep) to 1 or 255 "
                         "(fill)")
    if full_scale is None:  # floats
        if values.size and values.max() > 1:
            if values.max() > 255 or not np.array_equal(values, np.round(values)):
                raise ValueError(f"{name} holds floats up to {values.max():g}; give floats in [0, 1] (1 = to fill) "
                                 "or 8-bit levels")
            full_scale = 255  # floats holding 8-bit levels
        else:
            full_scale = 1
    elif values.size and values.max() > full_scale:
        raise ValueError(f"{name} holds values up to {values.max():g}, beyond 16 bits; give 0/1, 8-bit or 16-bit "
                         "masks")
    grey = _grey(values, full_scale, name)
    if full_scale > 1 and np.isin(grey, (0, 1)).all():
        full_scale = 1  # stored as 0 and 1
    unit = (grey / full_scale).astype(np.float32)
    if 0 < unit.max(initial=0) < 0.5:
        raise ValueError(f"{name}: its values reach {grey.max():g} of {full_scale:g} and none reaches half, so it "
                         "would fill nothing; a label map? save the pixels to fill as white (255, or 1) and the rest "
                         "black")
    return unit


def _grey(values: np.ndarray, full_scale: float, name: str) -> np.ndarray:
    """[H, W] of one mask's channels [H, W, C]: an opaque alpha dropped, transparency refused; the
    grey of RGB (Pillow's L weights) when its channels agree, colour refused."""
    channels = values.shape[-1]
    if channels in (2, 4):
        alpha = values[:, :, -1]
        if (alpha < full_scale).any():
            raise ValueError(f"{name} is transparent in places (alpha): in a mask, alpha may mean the area to fill "
                             "(OpenAI's edit masks) or nothing (diffusers drops it); save it without alpha, white "
                             "(or 1) = to fill")
        values = values[:, :, :-1]
    if values.shape[-1] == 1:
        return values[:, :, 0]
    spread = values.max(-1) - values.min(-1)
    if spread.max(initial=0) == 0:
        return values[:, :, 0]
    if spread.max() > GREY_TOLERANCE * full_scale:
        raise ValueError(f"{name} is in colour (its channels differ by up to {spread.max():g} of {full_scale:g}); "
                         "a mask is grey, white (or 1) = to fill: a label map's colours? save the pixels to fill as "
                         "white and the rest black")
    return values @ np.array(LUMA)


__all__ = ["binary_masks", "check_mask_size", "read_masks"]
