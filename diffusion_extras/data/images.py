"""Training images: loading through `datasets`, a decode-once cache, and position-determined batches.

Data order is a pure function of (seed, micro-step): micro-step k of the run is the k-th slice of
global batches drawn from per-epoch permutations. A resumed run therefore asks for batch k and
gets it directly, nothing is decoded and thrown away, and any number of ranks each take their
slice of the same global batch (so P ranks x B images see exactly what 1 rank x P*B would).
"""
from __future__ import annotations

import glob
import hashlib
import io
import logging
import os
import re
import time
import warnings

import numpy as np
import torch
from PIL import Image

from diffusion_extras.data.spec import DataSpec

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the cached layout or preprocessing changes


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


def find_image_column(dataset, image_column: str | None = None) -> str:
    import datasets

    columns = list(dataset.features)
    if image_column is not None:
        if image_column not in columns:
            raise DataError(f"--image_column {image_column} is not in the dataset (columns: {', '.join(columns)})")
        if not isinstance(dataset.features[image_column], datasets.Image):
            raise DataError(f"--image_column {image_column} holds {dataset.features[image_column]}, not images")
        return image_column
    found = [name for name, feature in dataset.features.items() if isinstance(feature, datasets.Image)]
    if not found:
        raise DataError(f"the dataset has no image column (columns: {', '.join(columns)}); "
                        "pass --image_column NAME for a column of images")
    return found[0]


# ----------------------------------------------------------------------------- class labels
def find_label_column(dataset, label_column: str | None = None) -> str:
    """--label_column, or the dataset's one ClassLabel column (an imagefolder's subfolder names,
    the digits' `label`)."""
    import datasets

    columns = list(dataset.features)
    if label_column is not None:
        if label_column not in columns:
            raise DataError(f"--label_column {label_column} is not in the dataset (columns: {', '.join(columns)})")
        return label_column
    found = [name for name, feature in dataset.features.items() if isinstance(feature, datasets.ClassLabel)]
    if len(found) != 1:
        what = "no ClassLabel column" if not found else f"several ClassLabel columns ({', '.join(found)})"
        raise DataError(f"--class_conditional: the dataset has {what} (columns: {', '.join(columns)}); "
                        "pass --label_column NAME for the column of class ids or names")
    return found[0]


def class_labels(dataset, label_column: str) -> tuple[np.ndarray, list[str]]:
    """(int64 class id per row, class names by id). A ClassLabel column declares its classes; any
    other column must hold non-negative ints (classes 0..max) or names (classes sorted by name)."""
    import datasets

    feature = dataset.features[label_column]
    values = dataset.with_format("arrow")[:].column(label_column).to_pylist()
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
    elif values and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        names = [str(i) for i in range(max(values) + 1)]
    elif values and all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
        values = [index[v] for v in values]
    else:
        bad = next((v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool)), values[:1])
        raise DataError(f"--label_column {label_column}: labels must be ints or class names (got {bad!r})")
    labels = np.asarray(values, dtype=np.int64)
    outside = labels[(labels < 0) | (labels >= len(names))]
    if len(outside):
        raise DataError(f"--label_column {label_column}: label {int(outside[0])} is outside the declared "
                        f"classes 0..{len(names) - 1} ({len(outside)} row(s))")
    empty = [names[i] for i in np.flatnonzero(np.bincount(labels, minlength=len(names)) == 0)]
    if empty:
        warnings.warn(f"--label_column {label_column}: class(es) with no images: {', '.join(empty)}", stacklevel=2)
    return labels, names


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


# ----------------------------------------------------------------------------- decode once
class DecodedImages:
    """Every training image decoded, converted and resized once, kept as uint8 (memory-mapped
    from the cache when one exists). Without center crop the shorter side equals the resolution
    and the random crop happens per batch; with it every image is already resolution^2."""

    def __init__(self, pixels: np.ndarray, shapes: np.ndarray, offsets: np.ndarray, channels: int):
        self.pixels, self.shapes, self.offsets, self.channels = pixels, shapes, offsets, channels

    def __len__(self) -> int:
        return len(self.shapes)

    def image(self, index: int) -> np.ndarray:
        height, width = self.shapes[index]
        start = self.offsets[index]
        return self.pixels[start:start + height * width * self.channels].reshape(height, width, self.channels)

    def as_array(self) -> np.ndarray:
        """All images [N, H, W, C] uint8; only when all share one shape (center crop)."""
        height, width = self.shapes[0]
        return np.asarray(self.pixels).reshape(len(self), height, width, self.channels)

    @classmethod
    def load(cls, directory: str, channels: int) -> DecodedImages:
        shapes = np.load(os.path.join(directory, "shapes.npy"))
        pixels = np.memmap(os.path.join(directory, "pixels.bin"), dtype=np.uint8, mode="r")
        return cls(pixels, shapes, _offsets(shapes, channels), channels)


def _offsets(shapes: np.ndarray, channels: int) -> np.ndarray:
    sizes = shapes[:, 0].astype(np.int64) * shapes[:, 1] * channels
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


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


def random_crop(image: np.ndarray, resolution: int, *seed_parts: int) -> np.ndarray:
    """A resolution^2 crop placed by mix_seed(*seed_parts), so a resumed run crops the same."""
    height, width = image.shape[:2]
    if height == width == resolution:
        return image
    rng = np.random.default_rng(mix_seed(*seed_parts))
    top = rng.integers(0, height - resolution + 1)
    left = rng.integers(0, width - resolution + 1)
    return image[top:top + resolution, left:left + resolution]


def _decode(item: dict) -> Image.Image:
    if item.get("bytes") is not None:
        return Image.open(io.BytesIO(item["bytes"]))
    return Image.open(item["path"])


DECODE_CHUNK = 512  # rows per decoding task


def _decode_rows(bounds: tuple[int, int], dataset, image_column: str, resolution: int, center_crop: bool,
                 channels: int) -> tuple[list, list]:
    """Decode rows [start, stop) from their stored bytes: (arrays, [(name, error)]). Runs in worker
    processes too; the arrow format hands over bytes and paths without decoding."""
    start, stop = bounds
    items = dataset.with_format("arrow")[start:stop].column(image_column).to_pylist()
    arrays, problems = [], []
    for offset, item in enumerate(items):
        try:
            arrays.append(decode_image(item, resolution, center_crop, channels))
        except Exception as error:  # PIL raises several types for truncated or non-image files
            problems.append((item.get("path") or f"row {start + offset}", f"{type(error).__name__}: {error}"))
    return arrays, problems


def decode_workers(num_rows: int) -> int:
    """Processes for decoding: all cores (up to 16) for datasets big enough to repay the start-up."""
    return min(os.cpu_count() or 1, 16) if num_rows >= 4 * DECODE_CHUNK else 1


def iter_decoded(dataset, image_column: str, resolution: int, center_crop: bool, channels: int,
                 workers: int = 1, progress: bool = False):
    """Every decodable image, in row order, as uint8 [H, W, C]; unreadable files are skipped with a
    warning that names them. Raises DataError if none can be decoded."""
    import functools
    from concurrent.futures import ProcessPoolExecutor

    from tqdm.auto import tqdm

    bounds = [(a, min(a + DECODE_CHUNK, len(dataset))) for a in range(0, len(dataset), DECODE_CHUNK)]
    task = functools.partial(_decode_rows, dataset=dataset, image_column=image_column, resolution=resolution,
                             center_crop=center_crop, channels=channels)
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    decoded, skipped = 0, []
    with tqdm(total=len(dataset), desc="decoding images once", disable=not progress) as bar:
        for arrays, problems in (pool.map(task, bounds) if pool else map(task, bounds)):
            for name, message in problems:
                skipped.append(name)
                warnings.warn(f"skipping unreadable image {name}: {message}", stacklevel=2)
            decoded += len(arrays)
            bar.update(len(arrays) + len(problems))
            yield from arrays
    if pool:
        pool.shutdown()
    if not decoded:
        raise DataError(f"none of the {len(dataset)} images could be decoded (first: {skipped[:3]})")


def decode_dataset(dataset, image_column: str, resolution: int, center_crop: bool, channels: int,
                   progress: bool = False) -> DecodedImages:
    """Decode every image once, in memory (small datasets: the digits)."""
    arrays = list(iter_decoded(dataset, image_column, resolution, center_crop, channels, progress=progress))
    shapes = np.array([a.shape[:2] for a in arrays], dtype=np.int64)
    pixels = np.concatenate([a.reshape(-1) for a in arrays])
    return DecodedImages(pixels, shapes, _offsets(shapes, channels), channels)


def cached_decode(dataset, image_column: str, resolution: int, center_crop: bool, channels: int,
                  cache_dir: str | None, progress: bool = False) -> DecodedImages:
    """Decoded images stored on disk, keyed by the dataset's fingerprint and the preprocessing, so
    later runs (and the other local ranks, which wait for the node's main one) only memory-map
    them. Images are written to the file as they are decoded (memory stays flat whatever the
    dataset size), by a process pool for large datasets. In-memory datasets (the digits) have no
    stable fingerprint and are decoded each time (under a second)."""
    if not dataset.cache_files:
        return decode_dataset(dataset, image_column, resolution, center_crop, channels, progress)
    import datasets

    key = hashlib.sha256(repr((CACHE_FORMAT, dataset._fingerprint, image_column, resolution,
                               center_crop, channels)).encode()).hexdigest()[:20]
    root = str(cache_dir or datasets.config.HF_DATASETS_CACHE)
    directory = os.path.join(root, "ddpm_decoded", key)
    if not os.path.isdir(directory):  # published whole by one rename: present means complete
        check_cache_space(root, len(dataset), resolution, channels)
        start = time.perf_counter()
        images = iter_decoded(dataset, image_column, resolution, center_crop, channels,
                              decode_workers(len(dataset)), progress)
        _write_cache(directory, images)
        # one line per decode: how often a node decoded is visible in its log (and tested)
        print(f"decoded {len(dataset)} images once into {directory} in {time.perf_counter() - start:.1f} s", flush=True)
    return DecodedImages.load(directory, channels)


def check_cache_space(root: str, rows: int, resolution: int, channels: int) -> None:
    """Refuse before decoding when the cache's disk cannot hold rows x resolution^2 x channels
    bytes (a lower bound: without --center_crop the stored images are larger)."""
    import shutil

    os.makedirs(root, exist_ok=True)
    needed, free = rows * resolution * resolution * channels, shutil.disk_usage(root).free
    if needed > free:
        raise DataError(f"the decoded-image cache needs at least {needed / 1e9:.2f} GB ({rows} images of "
                        f"{resolution}x{resolution}x{channels} bytes) but {root} has {free / 1e9:.2f} GB free: "
                        "use --streaming (decodes on the fly, no cache) or a --cache_dir on a larger disk")


def _write_cache(directory: str, images) -> None:
    """pixels.bin (every image's bytes, in order) and shapes.npy, written under a name no other
    process uses (host, pid, random) and published by one atomic rename. Nodes sharing a cache
    folder may race: the first rename wins, a loser deletes its copy and uses the winner's."""
    import shutil
    import socket
    import uuid

    tmp = f"{directory}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    shapes = []
    with open(os.path.join(tmp, "pixels.bin"), "wb") as fh:
        for array in images:
            fh.write(np.ascontiguousarray(array).tobytes())
            shapes.append(array.shape[:2])
    np.save(os.path.join(tmp, "shapes.npy"), np.array(shapes, dtype=np.int64))
    try:
        os.rename(tmp, directory)  # atomic; fails when the (non-empty) winner's folder is there
    except OSError:
        if not os.path.isfile(os.path.join(directory, "shapes.npy")):
            raise
        shutil.rmtree(tmp)


# ----------------------------------------------------------------------------- batch order
def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (seed, micro-step, ...), well mixed so neighbours differ."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, np.uint64)[0] >> 1)


class GlobalBatchOrder:
    """Which dataset rows micro-step k uses, for every rank: a function of (seed, k) only."""

    def __init__(self, num_examples: int, global_micro_batch_size: int, seed: int):
        if global_micro_batch_size > num_examples:
            raise DataError(f"the global batch ({global_micro_batch_size} images = batch size x processes) is larger "
                            f"than the dataset ({num_examples} images); lower --train_batch_size")
        self.num_examples, self.global_micro_batch_size, self.seed = num_examples, global_micro_batch_size, seed
        self.batches_per_epoch = num_examples // global_micro_batch_size  # the last partial batch is dropped
        self._epoch, self._permutation = None, None

    def position(self, micro_step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of a micro-step."""
        return divmod(micro_step, self.batches_per_epoch)

    def indices(self, micro_step: int) -> np.ndarray:
        epoch, batch = self.position(micro_step)
        if epoch != self._epoch:
            self._epoch = epoch
            self._permutation = np.random.default_rng(mix_seed(self.seed, epoch)).permutation(self.num_examples)
        return self._permutation[batch * self.global_micro_batch_size:(batch + 1) * self.global_micro_batch_size]


class MicroBatches(torch.utils.data.Dataset):
    """Item k = this rank's uint8 images [B, C, H, W] for micro-step k, or (images, int64 class
    labels [B]) when `labels` (one per image) is given. Use with DataLoader(batch_size=None,
    sampler=range(first, last)) so workers prefetch in order."""

    def __init__(self, images: DecodedImages, order: GlobalBatchOrder, rank: int, batch_size: int,
                 resolution: int, seed: int, labels: np.ndarray | None = None):
        self.images, self.order, self.rank, self.batch_size = images, order, rank, batch_size
        self.resolution, self.seed, self.labels = resolution, seed, labels

    def __len__(self) -> int:
        return 2 ** 62  # an endless stream; the sampler bounds it

    def __getitem__(self, micro_step: int) -> torch.Tensor:
        rows = self.order.indices(micro_step)[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        batch = np.empty((len(rows), self.resolution, self.resolution, self.images.channels), np.uint8)
        for slot, row in enumerate(rows):
            batch[slot] = random_crop(self.images.image(int(row)), self.resolution, self.seed, int(row), micro_step)
        images = torch.from_numpy(batch).permute(0, 3, 1, 2)
        return images if self.labels is None else (images, torch.from_numpy(self.labels[rows]))


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(uint8 images, int64 labels or None) of a data source's batch: images, or (images, labels)."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch, None)


def to_model_input(batch: torch.Tensor, device, flip: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [B, C, H, W] -> fp32 in [-1, 1] on the device; `flip` (bool [B]) mirrors images there."""
    images = batch.to(device, non_blocking=True).float().div_(127.5).sub_(1.0)
    if flip is not None:
        images = torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)
    return images


VALIDATION_STREAM = 0x48E1D0  # seed stream of the held-out split (and of the held-out timesteps and noise)


class ImageSubset:
    """Rows of DecodedImages, seen through the same small interface (len, image, channels)."""

    def __init__(self, images, rows: np.ndarray):
        self.images, self.rows, self.channels = images, np.asarray(rows, dtype=np.int64), images.channels

    def __len__(self) -> int:
        return len(self.rows)

    def image(self, index: int) -> np.ndarray:
        return self.images.image(int(self.rows[index]))


def split_held_out(images, fraction: float, seed: int) -> tuple[ImageSubset, ImageSubset]:
    """(training, held-out) rows, a seeded random split; the held-out part never enters training."""
    count = int(round(fraction * len(images)))
    if not 1 <= count < len(images):
        raise DataError(f"--validation_split {fraction} of {len(images)} images leaves {count} held out; "
                         "choose a fraction that keeps at least one image on each side")
    order = np.random.default_rng(mix_seed(seed, VALIDATION_STREAM)).permutation(len(images))
    return ImageSubset(images, np.sort(order[count:])), ImageSubset(images, np.sort(order[:count]))
