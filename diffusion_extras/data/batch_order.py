"""Position-determined batches: data order is a pure function of (seed, micro-step). Micro-step k of
the run is the k-th slice of global batches drawn from per-epoch permutations, so a resumed run
asks for batch k and gets it directly (nothing decoded and thrown away), and any number of ranks
each take their slice of the same global batch (P ranks x B images see what 1 rank x P*B would).
Also the seeded random crop, the model input in [-1, 1] and the held-out split."""
from __future__ import annotations

import numpy as np
import torch

from diffusion_extras.data.decode_cache import DecodedImages
from diffusion_extras.data.images import DataError
from diffusion_extras.data.spec import Resolution, image_size


def random_crop(image: np.ndarray, resolution: Resolution, *seed_parts: int) -> np.ndarray:
    """A crop of `resolution` (N or (height, width)) placed by mix_seed(*seed_parts), so a resumed
    run crops the same."""
    height, width = image.shape[:2]
    crop_height, crop_width = image_size(resolution)
    if (height, width) == (crop_height, crop_width):
        return image
    rng = np.random.default_rng(mix_seed(*seed_parts))
    top = rng.integers(0, height - crop_height + 1)
    left = rng.integers(0, width - crop_width + 1)
    return image[top:top + crop_height, left:left + crop_width]


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
    """Item k = this rank's images [B, C, H, W] (the cache's dtype) for micro-step k, or (images, int64 class
    labels [B]) when `labels` (one per image) is given. Use with DataLoader(batch_size=None,
    sampler=range(first, last)) so workers prefetch in order."""

    def __init__(self, images: DecodedImages, order: GlobalBatchOrder, rank: int, batch_size: int,
                 resolution: Resolution, seed: int, labels: np.ndarray | None = None):
        self.images, self.order, self.rank, self.batch_size = images, order, rank, batch_size
        self.resolution, self.seed, self.labels = resolution, seed, labels

    def __len__(self) -> int:
        return 2 ** 62  # an endless stream; the sampler bounds it

    def __getitem__(self, micro_step: int) -> torch.Tensor:
        rows = self.order.indices(micro_step)[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        batch = np.empty((len(rows), *image_size(self.resolution), self.images.channels), self.images.dtype)
        for slot, row in enumerate(rows):
            batch[slot] = random_crop(self.images.image(int(row)), self.resolution, self.seed, int(row), micro_step)
        images = torch.from_numpy(batch).permute(0, 3, 1, 2)
        return images if self.labels is None else (images, torch.from_numpy(self.labels[rows]))


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(images, int64 labels or None) of a data source's batch: images, or (images, labels); also
    (clean input, image condition or None) of a monitor's clean input (training/build.py clean_input)."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch, None)


# the stored value that means white, by storage dtype (images.PixelFormat); 0 means black
WHITE = {"uint8": 255.0, "uint16": 65535.0, "float32": 1.0}


def to_model_input(batch: torch.Tensor, device, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Stored pixels [B, C, H, W] (uint8, uint16 or float32 in [0, 1]) -> fp32 in [-1, 1] on the
    device, scaled from the storage's range; `flip` (bool [B]) mirrors images there."""
    white = WHITE[str(batch.dtype).removeprefix("torch.")]
    images = batch.to(device, non_blocking=True).float().div_(white / 2).sub_(1.0)
    if flip is not None:
        images = torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)
    return images


def as_uint8(images: np.ndarray) -> np.ndarray:
    """Stored pixels (uint8, uint16 or float32 in [0, 1]) as uint8, for what reads 8-bit images
    (the FID/KID feature extractors)."""
    if images.dtype == np.uint8:
        return images
    return np.round(images.astype(np.float64) * (255 / WHITE[images.dtype.name])).astype(np.uint8)


VALIDATION_STREAM = 0x48E1D0  # seed stream of the held-out split (and of the held-out timesteps and noise)


class ImageSubset:
    """Rows of DecodedImages, seen through the same small interface (len, image, channels)."""

    def __init__(self, images, rows: np.ndarray):
        self.images, self.rows, self.channels = images, np.asarray(rows, dtype=np.int64), images.channels
        self.dtype = images.dtype

    def __len__(self) -> int:
        return len(self.rows)

    def image(self, index: int) -> np.ndarray:
        return self.images.image(int(self.rows[index]))


def held_out_count(num_images: int, fraction: float) -> int:
    """How many of `num_images` images --validation_split `fraction` holds out."""
    return int(round(fraction * num_images))


def fitted_batch_size(num_examples: int, batch_size: int, num_processes: int) -> int:
    """The per-process batch for a data set of `num_examples`: `batch_size`, or where the global batch
    (x `num_processes`) would be larger than the data set, the largest whose global batch fits (at
    least 1: fewer images than processes is refused by GlobalBatchOrder)."""
    return min(batch_size, max(1, num_examples // num_processes))


def split_held_out(images, fraction: float, seed: int) -> tuple[ImageSubset, ImageSubset]:
    """(training, held-out) rows, a seeded random split; the held-out part never enters training."""
    count = held_out_count(len(images), fraction)
    if not 1 <= count < len(images):
        raise DataError(f"--validation_split {fraction} of {len(images)} images leaves {count} held out; "
                         "choose a fraction that keeps at least one image on each side")
    order = np.random.default_rng(mix_seed(seed, VALIDATION_STREAM)).permutation(len(images))
    return ImageSubset(images, np.sort(order[count:])), ImageSubset(images, np.sort(order[:count]))
