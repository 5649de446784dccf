"""Image conditions in the data (--conditioning): which column holds a stored condition (the
conditioning image of image-to-image, or an inpainting mask: a column of the dataset, or a folder
paired file by file with --train_data_dir, which pairs.py lists), each training image decoded with
it into one array of C + S channels (the image's C, the condition's S), and the random inpainting
masks.

Stored side by side, a pair is one image to the rest of the data layer: the decode-once cache, the
stream, the (seed, micro-step) batch order, the crops and the flips carry image and condition
together, unchanged. The step splits them (training/conditioning.py). Conditions derived from the
image (super-resolution's low-resolution input, random masks) are not stored: they are made in the
step, from (seed, micro-step), so a resume and any number of ranks see the same.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps

from diffusion_extras.data.images import (
    EIGHT_BIT,
    PixelFormat,
    decode_image,
    find_image_column,
    open_stored,
    preprocess_image,
)
from diffusion_extras.data.pairs import CONDITIONING_IMAGE_COLUMN, MASK_COLUMN
from diffusion_extras.data.spec import DataError, DataSpec, Resolution

EXIF_ORIENTATION = 0x0112  # the EXIF tag ImageOps.exif_transpose reads


class StoredCondition(NamedTuple):
    """The column of a stored condition and what it holds."""
    column: str
    mask: bool  # an inpainting mask (one channel), else a conditioning image (the images' channels)

    def channels(self, image_channels: int) -> int:
        return 1 if self.mask else image_channels


def decoded_like_images(condition: StoredCondition | None) -> tuple[str, ...]:
    """The column of a stored condition that is decoded as the images are (a conditioning image:
    its depth, transparency and sample range judged with theirs, images.stored_format), or ()."""
    return (condition.column,) if condition is not None and not condition.mask else ()


def stored_condition(spec: DataSpec) -> StoredCondition | None:
    """The stored condition of a run's data, or None (no condition, or one derived from the image)."""
    if spec.conditioning == "image":
        return StoredCondition(spec.conditioning_image_column or CONDITIONING_IMAGE_COLUMN, mask=False)
    if spec.conditioning == "inpainting" and (spec.mask_column or spec.mask_data_dir):
        return StoredCondition(spec.mask_column or MASK_COLUMN, mask=True)
    return None


def stored_channels(spec: DataSpec, image_channels: int) -> int:
    """S: the channels stored beside each image's C (0 when nothing is)."""
    condition = stored_condition(spec)
    return 0 if condition is None else condition.channels(image_channels)


def columns(dataset, spec: DataSpec) -> tuple[str, StoredCondition | None]:
    """(the image column, the stored condition or None) of a dataset or stream: the condition's
    column checked to hold images, the image column found among the others (find_image_column)."""
    import datasets

    condition = stored_condition(spec)
    if condition is not None:
        flag = "--mask_column" if condition.mask else "--conditioning_image_column"
        feature = dataset.features.get(condition.column)
        if feature is None:
            raise DataError(f"{flag} {condition.column} is not in the dataset (columns: {', '.join(dataset.features)})")
        if not isinstance(feature, datasets.Image):
            raise DataError(f"{flag} {condition.column} holds {feature}, not images")
    return find_image_column(dataset, spec.image_column, (condition.column,) if condition else ()), condition


def decode_pair(item: dict, condition_item: dict | None, resolution: Resolution, center_crop: bool, channels: int,
                condition: StoredCondition | None, pixels: PixelFormat = EIGHT_BIT) -> np.ndarray:
    """A stored image decoded and preprocessed ([H, W, C]; images.decode_image) and, with a stored
    `condition`, its condition beside it ([H, W, C + S]), decoded as the image is (a mask first read
    by the mask rule: stored_mask): resized to exactly the image's decoded size (the same crop for
    a pair of one aspect), so that random crops and flips take both alike."""
    image = decode_image(item, resolution, center_crop, channels, pixels)
    if condition is None:
        return image
    if condition_item is None:
        raise DataError(f"no {condition.column} for this image")
    with open_stored(condition_item) as stored:
        if condition.mask:
            name = condition_item.get("path") or f"the {condition.column} of the image"
            stored = stored_mask(stored, oriented_size(item), name)
        paired = preprocess_image(stored, image.shape[:2], True, condition.channels(channels), pixels)
    return np.concatenate([image, paired], axis=-1)


def stored_mask(mask: Image.Image, size: tuple[int, int], name: str) -> Image.Image:
    """A stored mask read by the one mask rule (evaluation/pipeline_masks.py, which the exported
    pipeline applies to its mask_image: 0/1 and 0/255, 8 and 16 bits, palettes, ...; refused by
    `name` where it cannot be read as meant), oriented by its EXIF tag as images are, at `size`
    (height, width: its image's; another size of the same aspect resized as the pipeline resizes
    one, another aspect refused), binarised: an 8-bit image of 0 and 255."""
    # the rule lives in the exported pipeline's files (an export loads without this package), the one
    # import across the layers that pyproject.toml allows; here, as it imports diffusers
    from diffusion_extras.evaluation.pipeline_masks import binary_masks

    try:
        binary = binary_masks(ImageOps.exif_transpose(mask), size, name)
    except ValueError as error:
        raise DataError(str(error)) from None
    return Image.fromarray(binary[0, 0].numpy().astype(np.uint8) * 255)


def oriented_size(item: dict) -> tuple[int, int]:
    """(height, width) of a stored image once its EXIF orientation is applied (from its header)."""
    with open_stored(item) as image:
        width, height = image.size
        quarter_turn = image.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8)  # exif_transpose swaps the sides
    return (width, height) if quarter_turn else (height, width)


def check_masks(pairs, count: int = 16) -> None:
    """The first `count` (image, mask) pairs of stored items read by the mask rule before training
    (stored_mask), so that masks the rule refuses (transparency, colour, label maps, another aspect)
    are one line naming the first, not a run of rows skipped while decoding."""
    for image_item, mask_item in itertools.islice(pairs, count):
        with open_stored(mask_item) as mask:
            stored_mask(mask, oriented_size(image_item), mask_item.get("path") or "one of the first masks")


# ----------------------------------------------------------------------------- random inpainting masks
MASK_KINDS = ("rectangle", "strokes", "half")
MASK_KIND_WEIGHTS = (0.4, 0.4, 0.2)  # halves: outpainting, and the digits benchmark's half masks


def random_mask(height: int, width: int, seed: int) -> np.ndarray:
    """bool [height, width], True = to fill: a rectangle (a quarter to three quarters of each side),
    one to four free-form strokes (random walks drawn with a brush of 1/8 to 1/3 of the shorter
    side, as LaMa's and Palette's masks), or one half of the image; drawn from `seed` alone."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    kind = MASK_KINDS[rng.choice(len(MASK_KINDS), p=MASK_KIND_WEIGHTS)]
    mask = np.zeros((height, width), dtype=bool)
    if kind == "rectangle":
        box_height = int(rng.integers(max(1, height // 4), max(1, 3 * height // 4) + 1))
        box_width = int(rng.integers(max(1, width // 4), max(1, 3 * width // 4) + 1))
        top, left = int(rng.integers(0, height - box_height + 1)), int(rng.integers(0, width - box_width + 1))
        mask[top:top + box_height, left:left + box_width] = True
    elif kind == "half":
        mask = half_mask(height, width, HALVES[int(rng.integers(4))])
    else:
        canvas = Image.new("L", (width, height), 0)
        draw = ImageDraw.Draw(canvas)
        shorter = min(height, width)
        for _ in range(int(rng.integers(1, 5))):
            brush = int(rng.integers(max(1, shorter // 8), max(1, shorter // 3) + 1))
            point = (float(rng.uniform(0, width)), float(rng.uniform(0, height)))
            points = [point]
            for _ in range(int(rng.integers(1, 5))):
                angle, length = rng.uniform(0, 2 * np.pi), rng.uniform(shorter / 8, shorter / 2)
                point = (float(np.clip(point[0] + length * np.cos(angle), 0, width - 1)),
                         float(np.clip(point[1] + length * np.sin(angle), 0, height - 1)))
                points.append(point)
            draw.line(points, fill=255, width=brush, joint="curve")
        mask = np.asarray(canvas) > 0
    return mask


HALVES = ("top", "bottom", "left", "right")


def half_mask(height: int, width: int, side: str) -> np.ndarray:
    """bool [height, width], True on the `side` half (one of HALVES), the shorter part for odd sides."""
    mask = np.zeros((height, width), dtype=bool)
    rows, columns = slice(None), slice(None)
    if side in ("top", "bottom"):
        rows = slice(None, height // 2) if side == "top" else slice(height - height // 2, None)
    else:
        columns = slice(None, width // 2) if side == "left" else slice(width - width // 2, None)
    mask[rows, columns] = True
    return mask


def random_masks(height: int, width: int, seeds) -> np.ndarray:
    """float32 [N, 1, height, width] of random_mask for each seed, 1 = to fill."""
    return np.stack([random_mask(height, width, int(seed)) for seed in seeds])[:, None].astype(np.float32)
