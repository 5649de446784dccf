"""How an image-conditioned pipeline reads its `image` argument: every form users hold images in
(PIL images of any mode, numpy arrays, torch tensors, uint8, uint16 or float, one, a batch or a
list), laid out as diffusers' VaeImageProcessor reads them and converted to the model's channels as
the trainer converts images (data/images.py, which an exported folder cannot import: transparency
composited on the run's --background, white unless the export records another, RGB -> L by Pillow's
weights). Copied into exported folders with pipeline_image_conditioned.py, which imports it
relatively; pipeline_masks.py reads its LUMA. numpy, torch and Pillow only."""
from __future__ import annotations

import numpy as np
import torch

COLOUR_CHANNELS = (1, 3, 4)  # grayscale, RGB, RGBA: what a channel axis of an image holds
LUMA = (0.299, 0.587, 0.114)  # RGB -> L as Pillow's convert("L") weighs it (ITU-R 601-2), the trainer's conversion
WHITE = (255, 255, 255)  # what transparency is composited on: the trainer's default --background


def _pil_image(image, channels: int, background: tuple = WHITE) -> np.ndarray:
    """A PIL image of any mode as float [H, W, channels] in [0, 1], as the trainer reads one
    (data/images.py, which this file cannot import): transparency composited on `background` (RGB
    0..255), then Pillow's convert to L or RGB."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in image.info:
        image = Image.alpha_composite(Image.new("RGBA", image.size, (*background, 255)), image.convert("RGBA"))
    array = np.asarray(image.convert("L" if channels == 1 else "RGB"), dtype=np.float32) / 255
    return array[:, :, None] if array.ndim == 2 else array


def _unit_float(image) -> torch.Tensor:
    """An array or tensor as a float tensor on the CPU in [0, 1]: 16-bit integers / 65535, other
    integers as 8-bit levels / 255, bool 0 or 1, floats as they are (diffusers' range)."""
    if isinstance(image, np.ndarray):
        sixteen = image.dtype == np.uint16
        values = torch.from_numpy(np.ascontiguousarray(image.astype(np.float32) if sixteen else image))
        if sixteen:
            return values / 65535
    else:
        values = image.detach().cpu()
    if values.dtype == torch.bool or values.is_floating_point():
        return values.float()
    return values.float() / (65535 if values.dtype == torch.uint16 else 255)


def _as_nchw(image, what: str) -> torch.Tensor:
    """One array or tensor as float [N, C, H, W] in [0, 1], its layout read by diffusers' convention
    (VaeImageProcessor: numpy channels-last, torch channels-first): numpy [H, W], [H, W, C] (one
    image) or [N, H, W, C]; torch [H, W], [C, H, W] (one image) or [N, C, H, W]; C 1, 3 or 4. A shape
    that fits none (a batch without its channel axis, the other library's layout) is refused by name,
    never guessed: [3, h, w] is one RGB image to a grayscale pipeline, not three grayscale ones."""
    is_numpy = isinstance(image, np.ndarray)
    values = _unit_float(image)
    shape = tuple(values.shape)
    if values.ndim == 2:
        return values[None, None]
    channel_axis = -1 if is_numpy else values.ndim - 3
    if values.ndim in (3, 4) and shape[channel_axis] in COLOUR_CHANNELS:
        values = values[None] if values.ndim == 3 else values
        return values.permute(0, 3, 1, 2) if is_numpy else values
    layout = ("[H, W], [H, W, C] or [N, H, W, C] (numpy is channels-last" if is_numpy
              else "[H, W], [C, H, W] or [N, C, H, W] (torch is channels-first")
    raise ValueError(f"{what} of shape {shape}: give {layout}, as diffusers' VaeImageProcessor reads it) with C "
                     "1, 3 or 4; a batch of grayscale images needs its channel axis of 1")


def _convert_channels(images: torch.Tensor, channels: int, background: tuple = WHITE) -> torch.Tensor:
    """[N, C, H, W] in [0, 1] as `channels` (1 or 3), as the trainer converts images: alpha composited
    on `background` (RGB 0..255), RGB -> L by Pillow's weights, L -> RGB by copies."""
    if images.shape[1] == 4:
        alpha = images[:, 3:]
        images = images[:, :3] * alpha + torch.tensor(background).view(1, 3, 1, 1) / 255 * (1 - alpha)
    if images.shape[1] == 3 and channels == 1:
        images = (images * torch.tensor(LUMA).view(1, 3, 1, 1)).sum(1, keepdim=True)
    elif images.shape[1] == 1 and channels == 3:
        images = images.expand(-1, 3, -1, -1)
    return images


def image_batch(image, channels: int, what: str = "image", background: tuple = WHITE) -> torch.Tensor:
    """What a pipeline's image argument holds, as float [N, channels, H, W] in [0, 1] on the CPU:
    a PIL image of any mode, a numpy array or a torch tensor (uint8, uint16 or float in [0, 1]; the
    layouts of _as_nchw), or a list of them; each read as meant and converted to the pipeline's
    channels as the trainer converts images (transparency on `background`, RGB 0..255). One size for
    all, or a one-line ValueError."""
    from PIL import Image

    items = image if isinstance(image, (list, tuple)) else [image]
    if not items:
        raise ValueError(f"{what} is an empty list: give at least one image")
    batches = []
    for item in items:
        if isinstance(item, Image.Image):
            batches.append(torch.from_numpy(_pil_image(item, channels, background)).permute(2, 0, 1)[None])
        elif isinstance(item, (np.ndarray, torch.Tensor)):
            batches.append(_convert_channels(_as_nchw(item, what), channels, background))
        else:
            raise ValueError(f"{what}: a {type(item).__name__}; give PIL images, numpy arrays or torch tensors")
    sizes = sorted({tuple(batch.shape[-2:]) for batch in batches})
    if len(sizes) > 1:
        raise ValueError(f"{what}: images of {len(sizes)} sizes ({sizes[0]}, {sizes[1]}, ...; height, width) in one "
                         "call: give images of one size")
    return torch.cat(batches).contiguous()


__all__ = ["COLOUR_CHANNELS", "LUMA", "WHITE", "image_batch"]
