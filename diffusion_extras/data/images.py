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

import numpy as np
from PIL import Image

from diffusion_extras.data.spec import DataSpec

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset problem found before training; the message names it and the fix."""


# ----------------------------------------------------------------------------- loading
def digits_dataset():
    """scikit-learn's 1,797 handwritten 8x8 digits (16 grey levels) as a datasets.Dataset: the
    default data, shipped inside a package, so a fresh machine trains with no network."""
    import datasets
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(p, mode="L") for p in pixels], "label": digits.target.tolist()},
        features=features)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.isabs(name)


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
    (`imagefolder`), --dataset_name (a save_to_disk folder, a folder load_dataset understands, or a
    Hub id; --dataset_config_name picks its configuration), else the embedded digits."""
    import datasets

    cache_dir = spec.cache_dir
    if spec.train_data_files:
        files, builder = resolve_data_files(spec.train_data_files)
        return _train_split(_call_loader(lambda: datasets.load_dataset(
            builder, data_files={"train": files}, cache_dir=cache_dir, streaming=streaming),
            f"--train_data_files {spec.train_data_files}"), spec.train_data_files)
    if spec.train_data_dir:
        return _train_split(_call_loader(lambda: datasets.load_dataset(
            "imagefolder", data_dir=spec.train_data_dir, cache_dir=cache_dir, streaming=streaming),
            f"--train_data_dir {spec.train_data_dir}"), spec.train_data_dir)
    if spec.dataset_name:
        name = os.path.expanduser(spec.dataset_name)
        if os.path.isdir(name) and _is_saved_to_disk(name):
            saved = _train_split(_call_loader(lambda: datasets.load_from_disk(name), f"--dataset_name {name}"), name)
            # a saved dataset streams from its own arrow files, in shards that ranks and workers split
            return saved.to_iterable_dataset(num_shards=min(len(saved), 64) or 1) if streaming else saved
        if os.path.isdir(name) or not _looks_like_path(name):
            return _train_split(_call_loader(lambda: datasets.load_dataset(
                name, spec.dataset_config_name, cache_dir=cache_dir, streaming=streaming),
                f"--dataset_name {name}"), name)
        raise DataError(f"--dataset_name {name}: no such folder (give an existing path or a Hub dataset id)")
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


def find_image_column(dataset, image_column: str | None = None) -> str:
    import datasets

    found = _named_or_typed(dataset, "--image_column", image_column, datasets.Image)
    if image_column is not None and not isinstance(dataset.features[image_column], datasets.Image):
        raise DataError(f"--image_column {image_column} holds {dataset.features[image_column]}, not images")
    if not found:
        raise DataError(f"the dataset has no image column (columns: {', '.join(dataset.features)}); "
                        "pass --image_column NAME for a column of images")
    return found[0]


# ----------------------------------------------------------------------------- channels
GRAYSCALE_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")  # PIL modes with one colour


def stored_channels(items) -> int | None:
    """3 if any of the stored images ({"bytes", "path"}) is in colour (RGB, RGBA, P, CMYK, ...), 1 if
    all are grayscale, None if none opens. Only the headers are read (PIL opens lazily)."""
    modes = set()
    for item in items:
        try:
            with _decode(item) as image:
                modes.add(image.mode)
        except Exception:  # an unreadable file is named (and skipped) by the decoder later
            continue
    return (1 if modes <= set(GRAYSCALE_MODES) else 3) if modes else None


def dataset_channels(dataset, image_column: str, count: int = 16) -> int:
    """Colour channels of the training images, judged by the first `count` rows."""
    items = dataset.with_format("arrow")[:count].column(image_column).to_pylist()
    return stored_channels(items) or 3


def preprocess_image(image: Image.Image, resolution: int, center_crop: bool, channels: int) -> np.ndarray:
    """Mode by the model's channels, shorter side to `resolution` (bicubic, antialiased when
    shrinking), then the centre square if asked. Returns uint8 [H, W, C]."""
    image = image.convert("L" if channels == 1 else "RGB")
    width, height = image.size
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    if size != image.size:
        image = image.resize(size, Image.BICUBIC)
    if center_crop:
        left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
        image = image.crop((left, top, left + resolution, top + resolution))
    array = np.asarray(image, dtype=np.uint8)
    return array[:, :, None] if array.ndim == 2 else array


def decode_image(item: dict, resolution: int, center_crop: bool, channels: int) -> np.ndarray:
    """A stored image ({"bytes", "path"}) decoded and preprocessed; raises on unreadable files."""
    with _decode(item) as image:
        image.load()
        return preprocess_image(image, resolution, center_crop, channels)


def _decode(item: dict) -> Image.Image:
    if item.get("bytes") is not None:
        return Image.open(io.BytesIO(item["bytes"]))
    return Image.open(item["path"])


