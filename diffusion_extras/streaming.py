"""Streaming training data: `load_dataset(..., streaming=True)`, a shuffle buffer, one shard of the
stream per rank (`split_dataset_by_node`), decoding and preprocessing on the fly; `StreamSource`
is the data source (sources.py) the loop sees.

For data that outgrows the disk. Progress is counted in steps, not epochs: the stream restarts
(with `set_epoch`, so the shuffle changes) whenever a rank exhausts its shard. Each rank's
position is the iterable dataset's own `state_dict()`, saved per rank in the checkpoint
(accelerate only saves the main process's custom objects, and positions differ per rank).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .data import DataError, decode_image, find_image_column, open_dataset, random_crop


def load_stream(config, rank: int, world_size: int):
    """This rank's shard of the shuffled stream, and its image column."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = open_dataset(config, streaming=True)
    if stream.features is None:
        raise DataError("the streamed dataset does not declare its features; pass --image_column and a dataset "
                        "whose features are known (parquet, imagefolder or a Hub dataset with metadata)")
    column = find_image_column(stream, config.image_column)
    # decoded by us, so a corrupt file is skipped and named instead of raising inside the iterator
    stream = stream.select_columns([column]).cast_column(column, datasets.Image(decode=False))
    if config.max_train_samples is not None:
        stream = stream.take(config.max_train_samples)
    if config.shuffle_buffer_size > 0:
        stream = stream.shuffle(seed=config.seed, buffer_size=config.shuffle_buffer_size)
    return split_dataset_by_node(stream, rank=rank, world_size=world_size), column


class StreamingBatches:
    """Iterator of this rank's uint8 micro-batches [B, C, H, W], with a resumable position."""

    def __init__(self, stream, column: str, batch_size: int, resolution: int, center_crop: bool,
                 channels: int, seed: int):
        self.stream, self.column, self.batch_size = stream, column, batch_size
        self.resolution, self.center_crop, self.channels, self.seed = resolution, center_crop, channels, seed
        self.epoch, self.examples_seen = 0, 0
        self._iterator = None

    def __iter__(self):
        return self

    def _next_example(self):
        for _ in range(2):  # one restart at most: an empty shard must not loop forever
            if self._iterator is None:
                self.stream.set_epoch(self.epoch)
                self._iterator = iter(self.stream)
            try:
                return next(self._iterator)[self.column]
            except StopIteration:
                self._iterator, self.epoch = None, self.epoch + 1
        raise DataError("this rank's shard of the stream is empty; use fewer processes or more data")

    def __next__(self) -> torch.Tensor:
        batch = np.empty((self.batch_size, self.resolution, self.resolution, self.channels), np.uint8)
        filled = 0
        while filled < self.batch_size:
            image = self._next_example()
            self.examples_seen += 1
            try:
                array = decode_image(image, self.resolution, self.center_crop, self.channels)
            except Exception as error:  # a corrupt file in a stream: skip it, name it, go on
                name = image.get("path") or f"#{self.examples_seen}"
                warnings.warn(f"skipping unreadable image {name}: {type(error).__name__}: {error}")
                continue
            batch[filled] = random_crop(array, self.resolution, self.seed, self.examples_seen)
            filled += 1
        return torch.from_numpy(batch).permute(0, 3, 1, 2)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "examples_seen": self.examples_seen, "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.examples_seen = state["epoch"], state["examples_seen"]
        self.stream.load_state_dict(state["stream"])
        self._iterator = None


def stream_reference_images(config, count: int, channels: int) -> np.ndarray:
    """Up to `count` centre-cropped images [N, C, H, W] from the start of an independent copy of the
    stream, for sigma_data and FID references; the training position is not touched."""
    stream, column = load_stream(config, 0, 1)
    images = []
    for item in stream.take(count):
        try:
            images.append(decode_image(item[column], config.resolution, True, channels))
        except Exception:  # unreadable: the training stream warns about it; references just skip it
            continue
    if not images:
        raise DataError("the stream yielded no readable image")
    return np.stack(images).transpose(0, 3, 1, 2)


class StreamSource:
    """A data source (see sources.py) over this rank's shard of the stream. The position is the
    stream's state, restored by load_state_dict before batches() is called."""

    batches_per_epoch = None  # unknown for a stream: runs are counted in steps (--max_train_steps)

    def __init__(self, config, accelerator, channels: int):
        shard, column = load_stream(config, accelerator.process_index, accelerator.num_processes)
        self.stream = StreamingBatches(shard, column, config.train_batch_size, config.resolution, config.center_crop,
                                       channels, config.seed + accelerator.process_index)
        self.config, self.channels, self.rank = config, channels, accelerator.process_index
        self.description = f"stream:{config.dataset_name or config.train_data_dir or config.train_data_files}"

    def batches(self, first: int, last: int):
        return self.stream  # already at `first`: the restored state, not the micro-step, holds the position

    def position(self, micro_step: int) -> dict:
        return {"epoch": self.stream.epoch, "batch_in_epoch": None}  # per-rank positions: rank_state files

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise DataError(f"the checkpoint holds no stream position for rank {self.rank}; resume a streaming "
                            "run from a checkpoint it saved, or start a new --output_dir")
        self.stream.load_state_dict(state)

    def reference_sample(self, count: int) -> np.ndarray:
        return stream_reference_images(self.config, count, self.channels)
