"""Training images in: the dataset a run names (a Hub id, a folder, a saved dataset, parquet or tar
shards, or the embedded digits) through `datasets`, its image column, its colour channels, and one
image's decoding and preprocessing. The class labels are labels.py; the decode-once cache is
decode_cache.py; the (seed, micro-step) batch order is batch_order.py."""
from __future__ import annotations

import glob
import io
import logging
import os
import re
import warnings
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps

from diffusion_extras.data.image_header import DEEP_MODES, ImageHeader, holds_grayscale, read_header
from diffusion_extras.data.pairs import paired_folder, paired_folders_dataset
from diffusion_extras.data.spec import DataError, DataSpec, Resolution, image_size

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- loading
def digits_dataset():
    """scikit-learn's 1,797 handwritten 8x8 digits (16 grey levels) as a datasets.Dataset: the
    default data, shipped inside a package, so a fresh machine trains with no network.

    Each image is stored as a binary PGM file (netpbm's greyscale format: a text header, then the
    raw bytes), which datasets' Image feature decodes through PIL like any image file, to the same
    8-bit pixels. Handing datasets PIL images instead makes it encode 1,797 PNGs at every start:
    0.24 s of CPU against 0.01 s (measured), a tenth of a tiny test run."""
    import datasets
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    height, width = pixels.shape[1:]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    images = [{"bytes": f"P5 {width} {height} 255\n".encode() + image.tobytes(), "path": None} for image in pixels]
    return datasets.Dataset.from_dict({"image": images, "label": digits.target.tolist()}, features=features)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.isabs(name)


def missing_dataset_folder(dataset_name: str) -> str | None:
    """The one-line error for a --dataset_name written as a path that names no folder (a Hub id is
    not checked here: that needs the network), else None. The config's validation asks it too, so
    the error comes before the training stack is imported."""
    name = os.path.expanduser(dataset_name)
    if _looks_like_path(name) and not os.path.isdir(name):
        return f"--dataset_name {name}: no such folder (give an existing path or a Hub dataset id)"
    return None


def load_image_dataset(spec: DataSpec):
    """The training split as a datasets.Dataset (open_dataset), cut to --max_train_samples."""
    dataset = open_dataset(spec)
    if spec.max_train_samples is not None and spec.max_train_samples < len(dataset):
        dataset = dataset.shuffle(seed=spec.seed).select(range(spec.max_train_samples))
    if len(dataset) == 0:
        raise DataError("the training dataset is empty")
    return dataset


def open_dataset(spec: DataSpec, streaming: bool = False):
    """The one dispatch from the data flags to the training split, a datasets.Dataset (or an
    IterableDataset when streaming), for both the cached and the streamed source: --train_data_files
    (.tar shards or parquet, through datasets' `webdataset` / `parquet` builders), --train_data_dir
    (`imagefolder`; with a paired folder of conditions or masks, the pairs: data/pairs.py),
    --dataset_name (a save_to_disk folder, a folder load_dataset understands, or a Hub id;
    --dataset_config_name picks its configuration), else the embedded digits."""
    import datasets

    cache_dir = spec.cache_dir
    if spec.train_data_files:
        files, builder = resolve_data_files(spec.train_data_files)
        return _train_split(_call_loader(lambda: datasets.load_dataset(
            builder, data_files={"train": files}, cache_dir=cache_dir, streaming=streaming),
            f"--train_data_files {spec.train_data_files}"), spec.train_data_files)
    if spec.train_data_dir:
        paired = paired_folder(spec)  # --conditioning_data_dir / --mask_data_dir: file by file with the images
        if paired is not None:
            dataset = paired_folders_dataset(spec.train_data_dir, *paired)
            return dataset.to_iterable_dataset(num_shards=min(len(dataset), 64)) if streaming else dataset
        return _train_split(_call_loader(lambda: datasets.load_dataset(
            "imagefolder", data_dir=spec.train_data_dir, cache_dir=cache_dir, streaming=streaming),
            f"--train_data_dir {spec.train_data_dir}"), spec.train_data_dir)
    if spec.dataset_name:
        name = os.path.expanduser(spec.dataset_name)
        if os.path.isdir(name) and _is_saved_to_disk(name):
            saved = _train_split(_call_loader(lambda: datasets.load_from_disk(name), f"--dataset_name {name}"), name)
            # a saved dataset streams from its own arrow files, in shards that ranks and workers split
            return saved.to_iterable_dataset(num_shards=min(len(saved), 64) or 1) if streaming else saved
        missing = missing_dataset_folder(name)
        if missing:
            raise DataError(missing)
        return _train_split(_call_loader(lambda: datasets.load_dataset(
            name, spec.dataset_config_name, cache_dir=cache_dir, streaming=streaming),
            f"--dataset_name {name}"), name)
    if streaming:
        raise DataError("--streaming needs --dataset_name or --train_data_dir or --train_data_files "
                        "(the embedded digits are in memory)")
    return digits_dataset()


DATA_FILE_BUILDERS = {".tar": "webdataset", ".parquet": "parquet"}  # datasets' packaged builders


def expand_braces(pattern: str) -> list[str]:
    """Shell-style brace lists, as webdataset shard names are written: `a-{0..9}.tar` (zero padding
    kept), `{train,extra}-*.tar`. datasets resolves globs but not braces."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    body, head, tail = match.group(1), pattern[:match.start()], pattern[match.end():]
    bounds = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if bounds:
        width = len(bounds.group(1)) if bounds.group(1).startswith("0") else 0
        options = [str(i).zfill(width) for i in range(int(bounds.group(1)), int(bounds.group(2)) + 1)]
    else:
        options = body.split(",")
    return [expanded for option in options for expanded in expand_braces(head + option + tail)]


def resolve_data_files(spec: str) -> tuple[list[str], str]:
    """(files, builder) for --train_data_files: whitespace-separated globs or brace lists of .tar
    shards or .parquet files, all of one kind. Local patterns must match something; remote ones
    (hf://, s3://, ...) are left to datasets to resolve."""
    files = []
    for pattern in (p for part in spec.split() for p in expand_braces(os.path.expanduser(part))):
        if "://" in pattern:
            files.append(pattern)
            continue
        matched = sorted(glob.glob(pattern))
        if not matched:
            raise DataError(f"--train_data_files: {pattern} matches no file")
        files += matched
    kinds = {os.path.splitext(f)[1].lower() for f in files}
    if len(kinds) != 1 or next(iter(kinds)) not in DATA_FILE_BUILDERS:
        raise DataError(f"--train_data_files must name only .tar shards or only .parquet files (got {sorted(kinds)})")
    return files, DATA_FILE_BUILDERS[kinds.pop()]


def _is_saved_to_disk(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def _call_loader(load, what: str):
    try:
        return load()
    except DataError:
        raise
    except Exception as error:  # datasets raises many types; the user needs the one line
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set: Hub ids cannot be downloaded; give a local folder)" if offline else ""
        raise DataError(f"{what}: could not load it: {type(error).__name__}: {first_line}{hint}") from None


def _train_split(loaded, name: str):
    import datasets

    if isinstance(loaded, (datasets.DatasetDict, dict)):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise DataError(f"{name} has splits {sorted(loaded)} and none is 'train'; save the split to train on")
    return loaded


def _named_or_typed(dataset, flag: str, name: str | None, feature_type) -> list[str]:
    """[the column `flag` names], checked to exist; with no name, the columns of `feature_type`."""
    columns = list(dataset.features)
    if name is not None:
        if name not in columns:
            raise DataError(f"{flag} {name} is not in the dataset (columns: {', '.join(columns)})")
        return [name]
    return [column for column, feature in dataset.features.items() if isinstance(feature, feature_type)]


def find_image_column(dataset, image_column: str | None = None, exclude: tuple = ()) -> str:
    """--image_column (checked), or the first column of images that is not in `exclude` (a stored
    condition's column)."""
    import datasets

    found = [column for column in _named_or_typed(dataset, "--image_column", image_column, datasets.Image)
             if image_column is not None or column not in exclude]
    if image_column is not None and not isinstance(dataset.features[image_column], datasets.Image):
        raise DataError(f"--image_column {image_column} holds {dataset.features[image_column]}, not images")
    if not found:
        raise DataError(f"the dataset has no image column (columns: {', '.join(dataset.features)}); "
                        "pass --image_column NAME for a column of images")
    return found[0]


# ----------------------------------------------------------------------------- channels and depth
PIXEL_DTYPES = ("uint8", "uint16", "float32")  # how decoded images are stored (cache, stream), by depth
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}


class PixelFormat(NamedTuple):
    """How decoded images are stored and how transparency is resolved (decode_cache, streaming)."""
    dtype: str = "uint8"                        # one of PIXEL_DTYPES: the deepest image of the data decides
    background: tuple = BACKGROUNDS["white"]    # RGB that transparent pixels are composited on (< 4 channels)


EIGHT_BIT = PixelFormat()  # 8-bit storage, transparency on white: the default


def parse_background(value: str) -> tuple:
    """--background: white, black or #rrggbb, as an RGB tuple."""
    if value in BACKGROUNDS:
        return BACKGROUNDS[value]
    if re.fullmatch(r"#[0-9a-fA-F]{6}", value or ""):
        return tuple(int(value[i:i + 2], 16) for i in (1, 3, 5))
    raise DataError(f"--background {value!r}: give white, black or a colour #rrggbb")


def storage_dtype(header: ImageHeader) -> str:
    """The storage a file's samples need to keep their precision: up to 256 levels uint8, up to
    65,536 uint16 (as unit values x 65535: a 12-bit or a signed 16-bit file too), else float32."""
    if isinstance(header.white, float):
        return "float32"
    levels = header.white - header.black + 1
    return "uint8" if levels <= 256 else "uint16" if levels <= 65536 else "float32"


def _unknown_range(header: ImageHeader) -> str:
    source = f"raw mode {header.raw_mode}" if header.raw_mode else "no file behind it"
    return (f"Pillow reads it as 32-bit integers (mode I, {source}) and nothing says which values are black and "
            "white: save it as a 16-bit PNG or TIFF, or a float TIFF in [0, 1]")


def _stored_headers(items) -> list:
    """(name, read_header, holds_grayscale) of each stored image ({"bytes", "path"}) that opens. Only
    the headers are read (PIL opens lazily)."""
    headers = []
    for index, item in enumerate(items):
        try:
            with open_stored(item) as image:
                headers.append((item.get("path") or f"image {index}", read_header(image), holds_grayscale(image)))
        except Exception:  # an unreadable file is named (and skipped) by the decoder later
            continue
    return headers


def stored_channels(items) -> int | None:
    """3 if any of the stored images is in colour (RGB, RGBA, a colour palette, CMYK, ...), 1 if all
    are grayscale (a 16-bit gray+alpha PNG and a grey palette too: holds_grayscale), None if none opens."""
    headers = _stored_headers(items)
    return (1 if all(grayscale for _, _, grayscale in headers) else 3) if headers else None


def stored_format(items, background: str = "white") -> PixelFormat:
    """The PixelFormat of the stored images: the deepest of their sample ranges (headers only). A
    file whose range cannot be known is refused here, before training; files with 16-bit samples
    that Pillow decodes to 8 bits are named in one warning."""
    headers = _stored_headers(items)
    for name, header, _ in headers:
        if header.white is None:
            raise DataError(f"{name}: {_unknown_range(header)}")
    reduced = [name for name, header, _ in headers if header.reduced]
    if reduced:
        warnings.warn(f"{reduced[0]} (and {len(reduced) - 1} more of the first images) holds 16-bit colour or "
                      "gray+alpha, which Pillow decodes to 8 bits per channel: it trains at 8-bit precision "
                      "(16-bit grayscale without alpha keeps 16 bits)", stacklevel=2)
    dtypes = {storage_dtype(header) for _, header, _ in headers}
    return PixelFormat(max(dtypes, key=PIXEL_DTYPES.index, default="uint8"), parse_background(background))


def dataset_channels(dataset, image_column: str, count: int = 16) -> int:
    """Colour channels of the training images, judged by the first `count` rows."""
    return stored_channels(_first_items(dataset, image_column, count)) or 3


def dataset_format(dataset, columns: tuple[str, ...], background: str = "white", count: int = 16) -> PixelFormat:
    """The PixelFormat of the training images, judged by the first `count` rows of their `columns`
    (the images', and a stored conditioning image's: a pair is one array, decoded alike)."""
    return stored_format([item for column in columns for item in _first_items(dataset, column, count)], background)


def _first_items(dataset, image_column: str, count: int) -> list:
    return dataset.with_format("arrow")[:count].column(image_column).to_pylist()


def _has_alpha(image: Image.Image) -> bool:
    """An alpha channel, or a transparency key (PNG's tRNS: a colour, a grey level or palette entries)."""
    return image.mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in image.info


def _as_8bit(image: Image.Image, channels: int, background: tuple) -> Image.Image:
    """An 8-bit image in L, RGB or RGBA (by `channels`): palettes, CMYK and transparency keys through
    Pillow's own conversions (convert("RGBA") turns a key into alpha), transparency composited on
    `background` (kept as the 4th channel when channels == 4)."""
    if channels == 4:
        return image.convert("RGBA")
    if _has_alpha(image):
        backdrop = Image.new("RGBA", image.size, (*background, 255))
        image = Image.alpha_composite(backdrop, image.convert("RGBA"))
    return image.convert("L" if channels == 1 else "RGB")


def _as_unit_float(image: Image.Image, header: ImageHeader, channels: int, background: tuple) -> np.ndarray:
    """float32 [H, W, channels] in [0, 1]: a deep image (one channel, DEEP_MODES) scaled from the
    file's sample range (read_header; a float image outside [0, 1] is refused: there is no range to
    scale it from), its transparency key (a 16-bit grayscale PNG's tRNS) composited on `background`
    or kept as alpha, as _as_8bit does; any other image through _as_8bit / 255."""
    if image.mode not in DEEP_MODES:
        array = np.asarray(_as_8bit(image, channels, background), dtype=np.float32) / 255
        return array[:, :, None] if array.ndim == 2 else array
    if header.white is None:
        raise DataError(_unknown_range(header))
    samples = np.asarray(image)
    if header.white > np.iinfo(np.int32).max:
        samples = samples.view(np.uint32)  # an unsigned 32-bit file: Pillow holds its bits in int32
    plane = (samples.astype(np.float64) - header.black) / (header.white - header.black)
    if image.mode == "F" and plane.size and (plane.min() < 0 or plane.max() > 1):
        raise DataError(f"a float image holds values in [{plane.min():g}, {plane.max():g}]; float images are "
                        "read as 0 = black, 1 = white: rescale it to [0, 1]")
    key = image.info.get("transparency")
    if not isinstance(key, int):  # no key: copies make colour, 1 the alpha
        planes = [plane] * min(channels, 3) + [np.ones_like(plane)] * (channels == 4)
        return np.stack(planes, axis=-1).astype(np.float32)
    opaque = samples != key
    if channels == 4:
        return np.stack([plane] * 3 + [opaque], axis=-1).astype(np.float32)
    # the background as the model's channels, through Pillow's own RGB -> L for grayscale
    levels = np.asarray(Image.new("RGB", (1, 1), background).convert("L" if channels == 1 else "RGB")).reshape(-1)
    return np.stack([np.where(opaque, plane, level / 255) for level in levels], axis=-1).astype(np.float32)


def preprocess_image(image: Image.Image, resolution: Resolution, center_crop: bool, channels: int,
                     pixels: PixelFormat = EIGHT_BIT) -> np.ndarray:
    """EXIF orientation applied, mode by the model's channels (4: RGBA), resized to the smallest size
    that covers `resolution` (N or (height, width)) keeping the aspect (bicubic, antialiased when
    shrinking), then the centre height x width if asked. Returns
    [H, W, C] of pixels.dtype: 8-bit images into uint8 through Pillow's 8-bit path; deep ones, and
    any image stored as uint16 (x 65535) or float32 (in [0, 1]), resized per channel in Pillow's
    float mode F, so no sample passes through 8 bits before the storage's own rounding."""
    header = read_header(image)  # first: what the file says is gone once the pixels load (exif_transpose)
    image = ImageOps.exif_transpose(image)  # a new image: setting its info leaves the caller's untouched
    if header.transparency is not None:
        image.info["transparency"] = header.transparency
    size, box = cover_and_crop(image.size, image_size(resolution), center_crop)
    if pixels.dtype == "uint8" and image.mode not in DEEP_MODES:
        array = np.asarray(_resize_crop(_as_8bit(image, channels, pixels.background), size, box), dtype=np.uint8)
        return array[:, :, None] if array.ndim == 2 else array
    unit = _as_unit_float(image, header, channels, pixels.background)
    planes = [np.asarray(_resize_crop(Image.fromarray(unit[:, :, c]), size, box)) for c in range(channels)]
    array = np.clip(np.stack(planes, axis=-1), 0.0, 1.0)  # bicubic overshoot, clamped as Pillow clamps 8-bit
    full_scale = {"uint8": 255, "uint16": 65535}.get(pixels.dtype)
    return array.astype(np.float32) if full_scale is None else np.round(array * full_scale).astype(pixels.dtype)


def cover_and_crop(image_wh: tuple[int, int], target_hw: tuple[int, int], center_crop: bool) -> tuple:
    """(the resized (width, height), the centre crop box or None) for an image of PIL size
    `image_wh` and a target (height, width): the scale that makes the image cover the target on
    both sides (max(H / h, W / w), the shorter side of a square target) keeps the aspect; the crop
    takes what overhangs evenly from both ends. Without the centre crop the random crop is per batch
    (batch_order.random_crop)."""
    (width, height), (target_height, target_width) = image_wh, target_hw
    scale = max(target_height / height, target_width / width)
    size = (max(target_width, round(width * scale)), max(target_height, round(height * scale)))
    if not center_crop:
        return size, None
    left, top = (size[0] - target_width) // 2, (size[1] - target_height) // 2
    return size, (left, top, left + target_width, top + target_height)


def _resize_crop(image: Image.Image, size: tuple, box: tuple | None) -> Image.Image:
    if size != image.size:
        image = image.resize(size, Image.BICUBIC)
    return image.crop(box) if box else image


def decode_image(item: dict, resolution: Resolution, center_crop: bool, channels: int,
                 pixels: PixelFormat = EIGHT_BIT) -> np.ndarray:
    """A stored image ({"bytes", "path"}) decoded and preprocessed; raises on unreadable files."""
    with open_stored(item) as image:
        return preprocess_image(image, resolution, center_crop, channels, pixels)


def open_stored(item: dict) -> Image.Image:
    """A stored image ({"bytes", "path"}) opened (lazily: its header read, not its pixels)."""
    if item.get("bytes") is not None:
        return Image.open(io.BytesIO(item["bytes"]))
    return Image.open(item["path"])
