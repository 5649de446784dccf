"""The decode-once cache: every training image decoded and preprocessed once (in worker processes),
stored on disk keyed by the dataset's fingerprint and the preprocessing, and memory-mapped by
later runs and by the other ranks of a node."""
from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings

import numpy as np

from diffusion_extras.data.conditioning import StoredCondition, decode_pair
from diffusion_extras.data.images import EIGHT_BIT, DataError, PixelFormat
from diffusion_extras.data.spec import Resolution, image_size

logger = logging.getLogger(__name__)


CACHE_FORMAT = 4  # bump when the cached layout or preprocessing changes (4: stored masks by the mask rule)


# ----------------------------------------------------------------------------- decode once
class DecodedImages:
    """Every training image decoded, converted and resized once, kept in its PixelFormat's dtype
    (uint8, uint16 or float32; memory-mapped from the cache when one exists). Without center crop
    each image just covers the resolution (one side equal to it) and the random crop happens per
    batch; with it every image is already height x width."""

    def __init__(self, pixels: np.ndarray, shapes: np.ndarray, offsets: np.ndarray, channels: int):
        self.pixels, self.shapes, self.offsets, self.channels = pixels, shapes, offsets, channels

    def __len__(self) -> int:
        return len(self.shapes)

    def image(self, index: int) -> np.ndarray:
        height, width = self.shapes[index]
        start = self.offsets[index]
        return self.pixels[start:start + height * width * self.channels].reshape(height, width, self.channels)

    def as_array(self) -> np.ndarray:
        """All images [N, H, W, C]; only when all share one shape (center crop)."""
        height, width = self.shapes[0]
        return np.asarray(self.pixels).reshape(len(self), height, width, self.channels)

    @property
    def dtype(self) -> np.dtype:
        return self.pixels.dtype

    @classmethod
    def from_arrays(cls, arrays: list, channels: int) -> DecodedImages:
        """In memory, from [H, W, channels] arrays of one dtype."""
        shapes = np.array([a.shape[:2] for a in arrays], dtype=np.int64)
        return cls(np.concatenate([a.reshape(-1) for a in arrays]), shapes, _offsets(shapes, channels), channels)

    @classmethod
    def load(cls, directory: str, channels: int, dtype: str = "uint8") -> DecodedImages:
        shapes = np.load(os.path.join(directory, "shapes.npy"))
        pixels = np.memmap(os.path.join(directory, "pixels.bin"), dtype=dtype, mode="r")
        return cls(pixels, shapes, _offsets(shapes, channels), channels)


def _offsets(shapes: np.ndarray, channels: int) -> np.ndarray:
    sizes = shapes[:, 0].astype(np.int64) * shapes[:, 1] * channels
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


DECODE_CHUNK = 512  # rows per decoding task


def _decode_rows(bounds: tuple[int, int], dataset, image_column: str, resolution: Resolution, center_crop: bool,
                 channels: int, pixels: PixelFormat = EIGHT_BIT,
                 condition: StoredCondition | None = None) -> tuple[list, list]:
    """Decode rows [start, stop) from their stored bytes: (arrays, [(name, error)]); with a stored
    `condition`, each image with its condition beside it (conditioning.decode_pair), a row skipped
    whole when either is unreadable. Runs in worker processes too; the arrow format hands over
    bytes and paths without decoding."""
    start, stop = bounds
    rows = dataset.with_format("arrow")[start:stop]
    items = rows.column(image_column).to_pylist()
    paired = rows.column(condition.column).to_pylist() if condition else [None] * len(items)
    arrays, problems = [], []
    for offset, (item, condition_item) in enumerate(zip(items, paired)):
        try:
            arrays.append(decode_pair(item, condition_item, resolution, center_crop, channels, condition, pixels))
        except Exception as error:  # PIL raises several types for truncated or non-image files
            problems.append((item.get("path") or f"row {start + offset}", f"{type(error).__name__}: {error}"))
    return arrays, problems


def decode_workers(num_rows: int) -> int:
    """Processes for decoding: all cores (up to 16) for datasets big enough to repay the start-up."""
    return min(os.cpu_count() or 1, 16) if num_rows >= 4 * DECODE_CHUNK else 1


def iter_decoded(dataset, image_column: str, resolution: Resolution, center_crop: bool, channels: int,
                 workers: int = 1, progress: bool = False, pixels: PixelFormat = EIGHT_BIT,
                 condition: StoredCondition | None = None):
    """Every decodable image, in row order, as [H, W, C] of pixels.dtype ([H, W, C + S] with a
    stored `condition`); unreadable files are skipped with a warning that names them. Raises
    DataError if none can be decoded."""
    import functools
    from concurrent.futures import ProcessPoolExecutor

    from tqdm.auto import tqdm

    bounds = [(a, min(a + DECODE_CHUNK, len(dataset))) for a in range(0, len(dataset), DECODE_CHUNK)]
    task = functools.partial(_decode_rows, dataset=dataset, image_column=image_column, resolution=resolution,
                             center_crop=center_crop, channels=channels, pixels=pixels, condition=condition)
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


def decode_dataset(dataset, image_column: str, resolution: Resolution, center_crop: bool, channels: int,
                   progress: bool = False, pixels: PixelFormat = EIGHT_BIT,
                   condition: StoredCondition | None = None) -> DecodedImages:
    """Decode every image once (with its stored `condition`), in memory (small datasets: the digits)."""
    arrays = list(iter_decoded(dataset, image_column, resolution, center_crop, channels, progress=progress,
                               pixels=pixels, condition=condition))
    return DecodedImages.from_arrays(arrays, channels + (condition.channels(channels) if condition else 0))


def cached_decode(dataset, image_column: str, resolution: Resolution, center_crop: bool, channels: int,
                  cache_dir: str | None, progress: bool = False,
                  pixels: PixelFormat = EIGHT_BIT, condition: StoredCondition | None = None) -> DecodedImages:
    """Decoded images stored on disk, keyed by the dataset's fingerprint and the preprocessing, so
    later runs (and the other local ranks, which wait for the node's main one) only memory-map
    them. Images are written to the file as they are decoded (memory stays flat whatever the
    dataset size), by a process pool for large datasets. In-memory datasets (the digits) have no
    stable fingerprint and are decoded each time (under a second). With a stored `condition` each
    image is stored with its condition beside it (C + S channels)."""
    key = decode_key(image_column, resolution, center_crop, channels, pixels, condition)
    located = cache_location(dataset, cache_dir, *key)
    if located is None:
        return decode_dataset(dataset, image_column, resolution, center_crop, channels, progress, pixels, condition)
    root, directory = located
    stored = channels + (condition.channels(channels) if condition else 0)
    if not os.path.isdir(directory):  # published whole by one rename: present means complete
        check_cache_space(root, len(dataset), resolution, stored, np.dtype(pixels.dtype).itemsize)
        start = time.perf_counter()
        images = iter_decoded(dataset, image_column, resolution, center_crop, channels,
                              decode_workers(len(dataset)), progress, pixels, condition)
        write_cache(directory, images)
        # one line per decode: how often a node decoded is visible in its log (and tested)
        print(f"decoded {len(dataset)} images once ({pixels.dtype} samples) into {directory} in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return DecodedImages.load(directory, stored, pixels.dtype)


def decode_key(image_column: str, resolution: Resolution, center_crop: bool, channels: int,
               pixels: PixelFormat, condition: StoredCondition | None = None) -> tuple:
    """What the decoded images depend on besides the dataset: the parts of their cache key (a
    resolution N, or (height, width), both sides; a stored condition's column and kind)."""
    key = image_column, resolution, center_crop, channels, tuple(pixels)
    return key if condition is None else (*key, tuple(condition))


def cache_location(dataset, cache_dir: str | None, *key_parts) -> tuple[str, str] | None:
    """(the cache root, the folder of what `key_parts` describe, keyed by the dataset's
    fingerprint), or None for an in-memory dataset (no stable fingerprint: made each time)."""
    if not dataset.cache_files:
        return None
    import datasets

    key = hashlib.sha256(repr((CACHE_FORMAT, dataset._fingerprint, *key_parts)).encode()).hexdigest()[:20]
    root = str(cache_dir or datasets.config.HF_DATASETS_CACHE)
    return root, os.path.join(root, "ddpm_decoded", key)


def check_cache_space(root: str, rows: int, resolution: Resolution, channels: int,
                      bytes_per_sample: int = 1) -> None:
    """Refuse before decoding when the cache's disk cannot hold rows x height x width x channels x
    bytes per sample (2 for 16-bit images, 4 for 32-bit ones: precision is kept, so the cache grows;
    a lower bound: without --center_crop the stored images are larger)."""
    import shutil

    os.makedirs(root, exist_ok=True)
    height, width = image_size(resolution)
    needed, free = rows * height * width * channels * bytes_per_sample, shutil.disk_usage(root).free
    if needed > free:
        raise DataError(f"the decoded-image cache needs at least {needed / 1e9:.2f} GB ({rows} images of "
                        f"{height}x{width}x{channels} samples of {bytes_per_sample} byte(s)) but {root} "
                        f"has {free / 1e9:.2f} GB free: "
                        "use --streaming (decodes on the fly, no cache) or a --cache_dir on a larger disk")


def write_cache(directory: str, images) -> None:
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
