"""Streaming training data: `load_dataset(..., streaming=True)`, a shuffle buffer, one shard of the
stream per rank (`split_dataset_by_node`), decoding and preprocessing on the fly; `StreamSource`
is the data source (sources.py) the loop sees.

For data that outgrows the disk. Images are decoded in DataLoader worker processes (a 256 px
JPEG costs milliseconds of a core: one thread cannot feed a GPU), prefetched and pinned. Shards
are split twice: between ranks (`split_dataset_by_node`) and, inside each rank, between its
workers (datasets does this in each worker), so every example is read once per epoch. Progress
is counted in steps, not epochs: each worker restarts its share (with `set_epoch`, so the
shard order and the shuffle change) when it runs out. The position is torchdata's
`StatefulDataLoader` state: every worker's (epoch, examples consumed in it) plus which worker
yields next, saved per rank in the checkpoint (accelerate only saves the main process's custom
objects, and positions differ per rank). A resume re-reads the worker's epoch up to that count.
"""
from __future__ import annotations

import itertools
import pickle
import warnings

import numpy as np
import torch

from diffusion_extras.data import conditioning
from diffusion_extras.data.batch_order import random_crop
from diffusion_extras.data.conditioning import StoredCondition, decode_pair
from diffusion_extras.data.images import EIGHT_BIT, DataError, PixelFormat, open_dataset, stored_format
from diffusion_extras.data.labels import Classes, LabelReader, stream_classes
from diffusion_extras.data.spec import DataSpec, Processes, Resolution
from diffusion_extras.data.workers import ignore_stop_signals, start_workers


def open_stream(spec: DataSpec):
    """The whole stream, cut to --max_train_samples, with its features known."""
    stream = open_dataset(spec, streaming=True)
    if stream.features is None:
        raise DataError("the streamed dataset does not declare its features; pass --image_column and a dataset "
                        "whose features are known (parquet, imagefolder or a Hub dataset with metadata)")
    return stream.take(spec.max_train_samples) if spec.max_train_samples is not None else stream


def read_stream_classes(spec: DataSpec) -> Classes:
    """The classes of the stream's examples (labels.stream_classes), before training."""
    return stream_classes(open_stream(spec), spec.label_column)


def first_stored_images(spec: DataSpec, count: int = 16) -> list:
    """The stream's first `count` images in stored order, undecoded ({"bytes", "path"}): what the
    colour channels and the pixel format are judged by, as cached data is judged by its first rows.
    The same images on every rank, and read without the shuffle: an iteration of a shuffled parquet
    stream ends with a 5-s sleep (datasets' workaround for apache/arrow#45214), which a start-up
    peek at the shuffled shard would pay."""
    import datasets
    stream = open_stream(spec)
    column, _ = conditioning.columns(stream, spec)
    stream = stream.select_columns([column]).cast_column(column, datasets.Image(decode=False))
    return [item[column] for item in stream.take(count)]


def first_stored_pairs(spec: DataSpec, condition: StoredCondition, count: int = 16) -> list:
    """The stream's first `count` (image, stored condition) pairs, undecoded, as first_stored_images."""
    import datasets
    stream = open_stream(spec)
    column, _ = conditioning.columns(stream, spec)
    stream = stream.select_columns([column, condition.column])
    for name in (column, condition.column):
        stream = stream.cast_column(name, datasets.Image(decode=False))
    return [(item[column], item[condition.column]) for item in stream.take(count)]


def load_stream(spec: DataSpec, rank: int, world_size: int, label_column: str | None = None):
    """This rank's shard of the shuffled stream, and its image column; examples keep the column
    that `label_column` reads (a 'struct.field' keeps the struct) and a stored condition's
    (conditioning.stored_condition) beside the image."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = open_stream(spec)
    column, condition = conditioning.columns(stream, spec)
    paired = [condition.column] if condition else []
    kept = [column] + ([label_column.split(".")[0]] if label_column else []) + paired
    # decoded by us, so a corrupt file is skipped and named instead of raising inside the iterator
    stream = stream.select_columns(kept)
    for name in [column, *paired]:
        stream = stream.cast_column(name, datasets.Image(decode=False))
    if spec.shuffle_buffer_size > 0:
        stream = stream.shuffle(seed=spec.seed, buffer_size=spec.shuffle_buffer_size)
    return split_dataset_by_node(stream, rank=rank, world_size=world_size), column


class DecodedStream(torch.utils.data.IterableDataset):
    """This rank's shard of the stream as decoded [C, H, W] images (of `pixels`' dtype), endlessly, epoch after
    epoch; in a DataLoader worker, over the worker's share of the shards. Its state (epoch, examples
    consumed in it, examples seen in all) is what StatefulDataLoader saves for each worker.

    Why not datasets' own state_dict: datasets keeps the epoch as ONE tensor in shared
    memory for all the workers of a process, and set_epoch is a read-modify-write on it
    (`_epoch += epoch - _epoch`). Two workers that set it together (both restored at once, or both
    at an epoch boundary) add their epochs up: 1 + 1 = 2. A worker then reads another epoch's shard
    order, and its saved {"epoch", position} names an epoch it is not in, so a restore lands at the
    start of the wrong epoch. So each worker iterates a private copy of the stream (its own epoch
    tensor), and the position is a pure function of what was consumed: our own (epoch, consumed)
    counters, restored by re-reading the epoch from its start and dropping `consumed` examples
    (read, not decoded), which also replays the shuffle buffer exactly."""

    def __init__(self, stream, column: str, resolution: Resolution, center_crop: bool, channels: int, seed: int,
                 label: LabelReader | None = None, pixels: PixelFormat = EIGHT_BIT,
                 condition: StoredCondition | None = None):
        self.stream, self.column, self.label, self.pixels = stream, column, label, pixels  # label: (image, class id)
        self.condition = condition  # a stored condition, decoded beside each image (C + S channels)
        self.resolution, self.center_crop, self.channels, self.seed = resolution, center_crop, channels, seed
        self.epoch, self.consumed, self.examples_seen = 0, 0, 0  # consumed: examples read in this epoch

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        worker_id = worker.id if worker is not None else 0
        # a pickled copy gets a fresh epoch tensor: no other worker writes to it
        stream = pickle.loads(pickle.dumps(self.stream))
        while True:
            stream.set_epoch(self.epoch)
            examples = iter(stream)  # in a worker, datasets reads only that worker's shards
            skipped = sum(1 for _ in itertools.islice(examples, self.consumed))  # a restored position
            if skipped < self.consumed:
                raise DataError(f"the stream's epoch {self.epoch} has {skipped} examples for this worker, the "
                                f"checkpoint says {self.consumed} were read: has the data changed?")
            for example in examples:
                self.consumed, self.examples_seen = self.consumed + 1, self.examples_seen + 1
                label = self.label(example) if self.label is not None else None
                array = self._decode(example)
                if array is not None:
                    crop = random_crop(array, self.resolution, self.seed, worker_id, self.examples_seen)
                    image = torch.from_numpy(np.array(crop)).permute(2, 0, 1)  # a writable copy
                    yield image if label is None else (image, label)  # collated to (images, int64 labels)
            if self.consumed == 0:
                return  # no shard for this worker (more workers than shards): the others go on
            self.epoch, self.consumed = self.epoch + 1, 0

    def _decode(self, example: dict):
        image = example[self.column]
        paired = example[self.condition.column] if self.condition else None
        try:
            return decode_pair(image, paired, self.resolution, self.center_crop, self.channels, self.condition,
                               self.pixels)
        except Exception as error:  # a corrupt file in a stream: skip it, name it, go on
            name = image.get("path") or f"#{self.examples_seen}"
            warnings.warn(f"skipping unreadable image {name}: {type(error).__name__}: {error}", stacklevel=2)
            return None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "examples_seen": self.examples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed, self.examples_seen = state["epoch"], state["consumed"], state["examples_seen"]


class StreamingBatches:
    """Iterator of this rank's micro-batches [B, C, H, W] (of `pixels`' dtype) (with `label`: [images, int64 class
    ids [B]]), decoded by `num_workers` worker
    processes (0: on this thread), with a resumable position. torchdata's StatefulDataLoader is
    used instead of torch's DataLoader because it saves and restores each worker's dataset state
    and the worker round-robin, so a resume continues at the exact example."""

    def __init__(self, stream, column: str, batch_size: int, resolution: Resolution, center_crop: bool,
                 channels: int, seed: int, num_workers: int = 0, pin_memory: bool = False,
                 label: LabelReader | None = None, pixels: PixelFormat = EIGHT_BIT,
                 condition: StoredCondition | None = None):
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.num_workers = num_workers
        self.loader = StatefulDataLoader(
            DecodedStream(stream, column, resolution, center_crop, channels, seed, label, pixels, condition),
            batch_size=batch_size,
            num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=4 if num_workers else None,
            worker_init_fn=ignore_stop_signals,  # a scheduler signals the workers too (data/workers.py)
            generator=torch.Generator())  # its own generator: creating the iterator must not touch the global RNG
        self._iterator, self._closed_at = None, None

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._iterator is None:
            self._iterator, self._closed_at = start_workers(self.loader), None
        try:
            return next(self._iterator)
        except StopIteration:
            raise DataError("this rank's shard of the stream is empty; use fewer processes or more data") from None

    def close(self) -> None:
        """End the loader's worker processes now, keeping the position (state_dict). The loader takes
        its own state back (StatefulDataLoader.load_state_dict), which drops its iterator: torch ends
        the workers when it frees that. A next batch would start new workers at the same position."""
        if self._iterator is not None:
            self._closed_at = self.loader.state_dict()
            self.loader.load_state_dict(self._closed_at)
            self._iterator = None

    def _loader_state(self) -> dict:
        # once closed, the loader would start workers to answer state_dict(): the position at close is it
        return self._closed_at if self._closed_at is not None else self.loader.state_dict()

    def _worker_states(self) -> list[dict]:
        return worker_states(self._loader_state())

    @property
    def epoch(self) -> int:
        return max((s["epoch"] for s in self._worker_states()), default=0)

    @property
    def examples_seen(self) -> int:
        return sum(s["examples_seen"] for s in self._worker_states())

    def state_dict(self) -> dict:
        return {"num_workers": self.num_workers, "loader": self._loader_state()}

    def load_state_dict(self, state: dict) -> None:
        if "loader" not in state:
            raise DataError("the checkpoint's stream position predates worker decoding (no loader state) and "
                            "cannot be restored exactly; start a new --output_dir")
        if state["num_workers"] != self.num_workers:
            raise DataError(f"the checkpoint's stream position was saved with --dataloader_num_workers "
                            f"{state.get('num_workers')} (each worker reads its own shards); resume with that value")
        if any("consumed" not in worker for worker in worker_states(state["loader"])):
            raise DataError("the checkpoint's stream position was saved from datasets' shared epoch, which DataLoader "
                            "workers race on, and may be wrong; start a new --output_dir")
        self.loader.load_state_dict(state["loader"])
        self._iterator, self._closed_at = None, None


def worker_states(loader_state: dict) -> list[dict]:
    """Each worker's DecodedStream state in a StatefulDataLoader state (one with no workers: its own)."""
    if "dataset_state" in loader_state:  # no workers
        return [loader_state["dataset_state"]] if loader_state["dataset_state"] else []
    workers = loader_state.get("_snapshot", {}).get("_worker_snapshots", {})
    return [w["dataset_state"] for w in workers.values() if w.get("dataset_state")]


def stream_reference_images(spec: DataSpec, count: int, channels: int,
                            pixels: PixelFormat = EIGHT_BIT) -> np.ndarray:
    """Up to `count` centre-cropped images [N, C, H, W] (with a stored condition: [N, C + S, H, W])
    from the start of an independent copy of the stream, for sigma_data and FID references; the
    training position is not touched."""
    stream, column = load_stream(spec, 0, 1)
    condition = conditioning.stored_condition(spec)
    images = []
    for item in stream.take(count):
        try:
            images.append(decode_pair(item[column], item[condition.column] if condition else None, spec.resolution,
                                      True, channels, condition, pixels))
        except Exception:  # unreadable: the training stream warns about it; references just skip it
            continue
    if not images:
        raise DataError("the stream yielded no readable image")
    return np.stack(images).transpose(0, 3, 1, 2)


class StreamSource:
    """A data source (see sources.py) over this rank's shard of the stream. The position is the
    stream's state, restored by load_state_dict before batches() is called."""

    batches_per_epoch = None  # unknown for a stream: runs are counted in steps (--max_train_steps)
    held_out_images = None  # --validation_split needs a fixed set: cached data only (validate refuses it)

    def __init__(self, spec: DataSpec, processes: Processes, channels: int, classes: Classes | None = None,
                 firsts: list | None = None):
        """`firsts`: first_stored_images(spec), when the caller has read them (open_training_data)."""
        shard, column = load_stream(spec, processes.process_index, processes.num_processes,
                                    classes.column if classes else None)
        condition = conditioning.stored_condition(spec)
        pairs = first_stored_pairs(spec, condition) if condition is not None else []
        if condition is not None and condition.mask:  # refused before training, where it can be
            conditioning.check_masks(pairs)
        conditions = [paired for _, paired in pairs] if conditioning.decoded_like_images(condition) else []
        firsts = first_stored_images(spec) if firsts is None else firsts
        self.pixels = stored_format(firsts + conditions, spec.background)  # a pair is one array: the deeper
        self.stream = StreamingBatches(shard, column, spec.train_batch_size, spec.resolution, spec.center_crop,
                                       channels, spec.seed + processes.process_index,
                                       spec.dataloader_num_workers, processes.device.type == "cuda",
                                       classes.reader() if classes else None, self.pixels,
                                       conditioning.stored_condition(spec))
        self.class_names = classes.names if classes else None  # labels come with each example
        self.spec, self.channels, self.rank = spec, channels, processes.process_index
        self.description = f"stream:{spec.dataset_name or spec.train_data_dir or spec.train_data_files}"

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
        return stream_reference_images(self.spec, count, self.channels, self.pixels)

    def reference_images(self, count: int) -> np.ndarray:
        """FID's reference in a latent run: a stream's batches are pixels there too (sources.CachedImages)."""
        return self.reference_sample(count)
