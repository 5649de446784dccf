"""Where training images come from, behind one interface: the loop, resume, checkpoints and the
artifacts (sigma_data, FID references) see a data source and never ask which kind it is.

    source = build_source(spec, processes, channels, dataset, validation_split, classes)
    batches = source.batches(first, last)   # this rank's [B, C, H, W] micro-batches, first..last-1 (uint8,
                                            # or uint16 / float32 for deeper images: images.PixelFormat);
                                            # (images, int64 labels [B]) pairs when class_names is set
    source.class_names                      # class names by id (--class_conditional), or None
    source.position(micro_step)             # {"epoch", "batch_in_epoch"} for the train state
    source.state_dict() / load_state_dict() # this rank's position, when the micro-step alone cannot say it
    source.reference_sample(count)          # NCHW training images as batches hold them, the run's position untouched
    source.held_out_images                  # images kept out of training (--validation_split), or None

Two kinds: `CachedImages` (decoded once, a (seed, micro-step) order: the position is a function of
the step, nothing to save) and `streaming.StreamSource` (decoded on the fly; the position is the
stream's own state, saved per rank). With --class_conditional both serve (images, labels) pairs:
the cache from one array of labels read once (labels.read_classes), the stream from each example.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch

from diffusion_extras.data import batch_order, conditioning, decode_cache, labels, latents, workers
from diffusion_extras.data import images as data
from diffusion_extras.data.spec import DataSpec, Processes, Resolution
from diffusion_extras.data.streaming import StreamSource, first_stored_images, read_stream_classes


class DataSource(Protocol):
    """The interface above, as a type."""
    batches_per_epoch: int | None  # None for a stream (no epoch length)
    description: str                  # names the data in the FID reference fingerprint
    held_out_images: object           # batch_order.ImageSubset, or None
    class_names: list | None       # names by class id with --class_conditional (batches carry labels), else None

    def batches(self, first: int, last: int) -> Iterator[torch.Tensor]: ...  # closed by the loop if it has close()
    def position(self, micro_step: int) -> dict: ...
    def state_dict(self) -> dict | None: ...
    def load_state_dict(self, state: dict | None) -> None: ...
    def reference_sample(self, count: int) -> np.ndarray: ...


class CachedImages:
    """Every image decoded once (decode_cache.cached_decode) and drawn in a (seed, micro-step) order;
    with an `encoder` (latent diffusion), every image's VAE posterior, encoded once (latents.py)."""

    def __init__(self, spec: DataSpec, processes: Processes, channels: int, dataset=None,
                 validation_split: float = 0.0, classes: labels.Classes | None = None,
                 encoder: latents.Encoder | None = None):
        # once per node: the node's first rank loads and decodes, the others then read its cache
        with processes.local_main_process_first():
            dataset = dataset if dataset is not None else data.load_image_dataset(spec)
            image_column, condition = conditioning.columns(dataset, spec)  # a stored condition: beside each image
            if condition is not None and condition.mask:  # refused before decoding, where it can be
                rows = dataset.with_format("arrow")[:16]
                conditioning.check_masks(zip(rows.column(image_column).to_pylist(),
                                             rows.column(condition.column).to_pylist()))
            # 16/32-bit images keep their depth, and so do conditioning images (a mask is binary: 8 bits)
            pixels = data.dataset_format(dataset, (image_column, *conditioning.decoded_like_images(condition)),
                                         spec.background)
            self.images = decode_cache.cached_decode(dataset, image_column, spec.resolution, spec.center_crop,
                                                     channels, spec.cache_dir, processes.is_local_main_process,
                                                     pixels, condition)
            self.pixels = self.images  # what FID compares with (reference_images)
            if encoder is not None:  # the pixels are read once more, to encode them (in memory: the digits)
                key = decode_cache.decode_key(image_column, spec.resolution, spec.center_crop, channels, pixels)
                self.images = latents.cached_latents(self.images, encoder, dataset, spec.cache_dir, key,
                                                     processes.is_local_main_process)
        # latents: their (h, w), the pixels' / the VAE's factor
        self.resolution = tuple(int(side) for side in self.images.shapes[0]) if encoder is not None else spec.resolution
        if classes is None and spec.class_conditional:  # a caller that opened nothing (open_training_data reads them)
            classes = labels.read_classes(dataset, spec.label_column)
        self.labels = classes.row_labels if classes else None
        self.class_names = classes.names if classes else None
        if self.labels is not None and len(self.labels) != len(self.images):
            raise data.DataError(f"{len(self.labels) - len(self.images)} image(s) could not be decoded: with "
                                 "--class_conditional every image needs its label; remove the unreadable files")
        self.held_out_images = None  # --validation_split: held out before the order exists, never trained on
        if validation_split:
            self.images, self.held_out_images = batch_order.split_held_out(self.images, validation_split, spec.seed)
            self.pixels = batch_order.ImageSubset(self.pixels, self.images.rows)  # reference_images: the same rows
            if self.labels is not None:
                self.labels = self.labels[self.images.rows]
        self.order = batch_order.GlobalBatchOrder(len(self.images), spec.train_batch_size * processes.num_processes,
                                           spec.seed)
        self.spec, self.rank = spec, processes.process_index
        self.pin_memory = processes.device.type == "cuda"
        self.batches_per_epoch = self.order.batches_per_epoch
        self.description = str(len(self.images))  # names the data in the FID reference fingerprint

    def batches(self, first: int, last: int):
        """Micro-batches first..last-1, prefetched in order by the DataLoader workers, which start now
        and end when the iterator is closed (or exhausted)."""
        spec = self.spec
        loader = torch.utils.data.DataLoader(
            batch_order.MicroBatches(self.images, self.order, self.rank, spec.train_batch_size, self.resolution,
                                     spec.seed, self.labels),
            batch_size=None, sampler=range(first, last), num_workers=spec.dataloader_num_workers,
            pin_memory=self.pin_memory, worker_init_fn=workers.ignore_stop_signals,
            generator=torch.Generator())  # its own generator: creating the iterator must not touch the global RNG
        return workers.closable(workers.start_workers(loader))  # started here, outside any training step

    def position(self, micro_step: int) -> dict:
        epoch, batch = self.order.position(micro_step)
        return {"epoch": epoch, "batch_in_epoch": batch}

    def state_dict(self) -> None:
        return None  # the position is a function of the micro-step: nothing per rank to save

    def load_state_dict(self, state) -> None:
        pass

    def reference_sample(self, count: int) -> np.ndarray:
        """Up to `count` training images NCHW (as batches hold them), a seeded random subset with the run's crops."""
        return self._seeded_subset(self.images, self.resolution, count)

    def reference_images(self, count: int) -> np.ndarray:
        """The pixel images of reference_sample's subset: the same for a pixel run; for a latent
        run (whose batches hold posteriors) the images they were encoded from (FID's reference)."""
        return self._seeded_subset(self.pixels, self.spec.resolution, count)

    def _seeded_subset(self, images, resolution: Resolution, count: int) -> np.ndarray:
        count = min(len(images), count)
        order = batch_order.GlobalBatchOrder(len(images), count, self.spec.seed)
        return batch_order.MicroBatches(images, order, 0, count, resolution, self.spec.seed)[0].numpy()


def open_training_data(spec: DataSpec, processes: Processes) -> tuple:
    """(the opened dataset, or a stream's first stored images; the images' colour channels: 1 or 3,
    or 4 with --keep_alpha; the classes or None),
    judged from the first images' modes and the labels before any model exists, so that a model
    can follow the data. The first element and the classes are handed to build_source (a stream
    is reopened there, lazily, per rank; its pixel format is judged by the same first images)."""
    if spec.streaming:
        firsts = first_stored_images(spec)
        channels = 4 if spec.keep_alpha else data.stored_channels(firsts) or 3
        return firsts, channels, read_stream_classes(spec) if spec.class_conditional else None
    with processes.local_main_process_first():  # the node's first rank downloads, the others reuse it
        dataset = data.load_image_dataset(spec)
    column, _ = conditioning.columns(dataset, spec)
    channels = 4 if spec.keep_alpha else data.dataset_channels(dataset, column)
    return dataset, channels, labels.read_classes(dataset, spec.label_column) if spec.class_conditional else None


def build_source(spec: DataSpec, processes: Processes, channels: int, dataset=None, validation_split: float = 0.0,
                 classes: labels.Classes | None = None, encoder: latents.Encoder | None = None):
    """The run's data source: a stream with --streaming, else the decode-once cache (of `dataset`,
    when open_training_data already opened it) less its held-out fraction (a stream has none:
    training/validation.py refuses --validation_split with --streaming). `classes` (--class_conditional):
    the classes open_training_data read; the batches then carry labels. For a stream, `dataset` is
    what open_training_data returned in its place (the first stored images), or None. `encoder`
    (latent diffusion): the cache holds each image's VAE posterior; a stream still serves pixels,
    which the step encodes (latents.Posterior)."""
    if spec.streaming:
        return StreamSource(spec, processes, channels, classes, dataset)
    return CachedImages(spec, processes, channels, dataset, validation_split, classes, encoder)
