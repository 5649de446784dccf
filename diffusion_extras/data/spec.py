"""What the data layer is given: which images and how a run reads them (`DataSpec`), and which
process is reading (`Processes`); the error it raises (`DataError`). Nothing else of a training
config reaches the data parts.

    spec = DataSpec(train_data_dir="my_images", resolution=32, train_batch_size=16)
    source = build_source(spec, accelerate.PartialState(), channels=3)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the training config builds a DataSpec: it imports without torch (tests/test_first_contact.py)
    import torch


Resolution = int | tuple[int, int]  # pixels: N (square), or (height, width)


class DataError(ValueError):
    """A dataset problem found before training; the message names it and the fix."""


@dataclass(frozen=True)
class DataSpec:
    """The settings the data parts use, named as the training flags that set them."""
    dataset_name: str | None = None          # Hub id or a local dataset folder; none of the three: the digits
    dataset_config_name: str | None = None   # load_dataset's `name`
    train_data_dir: str | None = None        # a folder of images (datasets' imagefolder)
    train_data_files: str | None = None      # globs / brace lists of .tar or .parquet shards
    image_column: str | None = None          # found from the features when None
    class_conditional: bool = False          # batches carry class labels
    label_column: str | None = None          # the labels; None: the dataset's one ClassLabel column
    conditioning: str = "none"               # an image condition: super_resolution, inpainting, image (or none)
    mask_column: str | None = None           # inpainting: stored masks, a column ...
    mask_data_dir: str | None = None         # ... or a folder paired with train_data_dir
    conditioning_image_column: str | None = None  # image-to-image: the conditioning images, a column ...
    conditioning_data_dir: str | None = None  # ... or a folder paired with train_data_dir
    cache_dir: str | None = None             # datasets' cache and the decoded-image cache
    max_train_samples: int | None = None     # keep this many images (a seeded subset)
    resolution: Resolution = 16              # pixels: N (square) or (height, width)
    center_crop: bool = True                 # else a (seed, image) random crop
    background: str = "white"                # transparent pixels composited on it: white, black or #rrggbb
    keep_alpha: bool = False                 # keep transparency as a 4th channel instead (RGBA)
    streaming: bool = False                  # decode on the fly instead of once
    shuffle_buffer_size: int = 1000          # examples; streaming only, 0: no shuffle
    dataloader_num_workers: int = 0          # loader worker processes (a stream's decoders)
    train_batch_size: int = 64               # images per process per micro-batch
    seed: int = 0                            # data order, crops, stream shuffle

    @property
    def uses_embedded_digits(self) -> bool:
        """No data named: scikit-learn's digits, the embedded default."""
        return not (self.train_data_files or self.train_data_dir or self.dataset_name)


def image_size(resolution: Resolution | list[int]) -> tuple[int, int]:
    """(height, width) in pixels of a resolution: N is N x N; a pair is (height, width), as torch's
    shapes and diffusers' sample_size order them."""
    if isinstance(resolution, int):
        return resolution, resolution
    height, width = resolution
    return int(height), int(width)


def as_resolution(size: Resolution | list[int]) -> Resolution:
    """A size as a Resolution: N for a square (an int, as a square run has always stored it), else
    (height, width); e.g. a UNet's sample_size, an int or a list."""
    height, width = image_size(size)
    return height if height == width else (height, width)


def resolution_text(resolution: Resolution | list[int]) -> str:
    """A resolution as --resolution takes it: 32, or 32x64 (height x width) when not square."""
    height, width = image_size(resolution)
    return str(height) if height == width else f"{height}x{width}"


class Processes(Protocol):
    """Which process of how many is reading, on which device. accelerate's PartialState and
    Accelerator both are one."""
    process_index: int
    num_processes: int
    is_local_main_process: bool
    device: torch.device

    def local_main_process_first(self) -> contextlib.AbstractContextManager: ...
