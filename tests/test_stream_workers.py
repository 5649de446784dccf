"""Streaming decoded in DataLoader workers (torchdata's StatefulDataLoader over datasets'
IterableDataset): rank x worker shards cover every example once per epoch, and a saved position
resumes at the exact example, with 0 or 2 workers."""
import json
import math
import os

import datasets
import faults
import pytest
import torch
from helpers import assert_same_state, load_unet_weights, read_history, run_training, write_tar_shards
from processes import launch_training

from diffusion_extras.data import streaming
from diffusion_extras.data.images import DataError
from diffusion_extras.training.config import TrainConfig

GREY_STEP = 7  # image i has grey value 7*i: 32 images stay below 256


@pytest.fixture
def shards(tmp_path):
    """8 .tar shards of 4 JPEG images each."""
    return write_tar_shards(tmp_path / "shards", shards=8, per_shard=4, grey_step=GREY_STEP)


def batches_for(folder, rank=0, world=1, workers=0, batch=4, buffer=0):
    config = TrainConfig(train_data_files=f"{folder}/train-*.tar", streaming=True, shuffle_buffer_size=buffer,
                         resolution=8)
    stream, column = streaming.load_stream(config, rank, world)
    return streaming.StreamingBatches(stream, column, batch, 8, True, 1, seed=0, num_workers=workers)


def ids(batch):
    return [int(round(float(image.float().mean()) / GREY_STEP)) for image in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_times_workers_cover_every_example_once_per_epoch(shards, workers):
    seen = []
    for rank in (0, 1):
        batches = batches_for(shards, rank, 2, workers)
        seen += [i for _ in range(4) for i in ids(next(batches))]  # 16 images per rank per epoch
        assert batches.epoch == 0
        next(batches)
        assert batches.epoch == 1  # the next batch starts the rank's second epoch
    assert sorted(seen) == list(range(32))


@pytest.mark.parametrize("workers", [0, 2])
def test_saved_position_resumes_at_the_exact_example(shards, workers):
    original = batches_for(shards, workers=workers)
    for _ in range(5):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))  # as the checkpoint stores it
    expected = [next(original) for _ in range(8)]  # crosses the epoch boundary (8 batches per epoch)
    resumed = batches_for(shards, workers=workers)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(expected, (next(resumed) for _ in range(8))))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("stop", [7, 8, 9])  # 2 workers: 4 batches a worker-epoch, both at its end after 8
def test_resume_around_an_epoch_boundary_is_exact_while_workers_race_on_set_epoch(shards, monkeypatch, workers, stop):
    """The race: the workers share datasets' epoch tensor; restored together, they both add their
    epoch to it (1 + 1 = 2) and read an epoch whose shard order and saved position are not theirs."""
    original = batches_for(shards, workers=workers)
    for _ in range(stop):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))
    expected = [ids(next(original)) for _ in range(10)]  # into the next worker-epoch of every worker
    monkeypatch.setattr(datasets.IterableDataset, "set_epoch", faults.slow_set_epoch(0.2))
    resumed = batches_for(shards, workers=workers)
    resumed.load_state_dict(state)
    assert [ids(next(resumed)) for _ in range(10)] == expected


def test_resume_with_another_worker_count_is_refused_naming_the_flag(shards):
    original = batches_for(shards, workers=2)
    next(original)
    with pytest.raises(DataError, match="--dataloader_num_workers 2"):
        batches_for(shards, workers=0).load_state_dict(original.state_dict())


def test_more_workers_than_shards_still_serve_every_example(tmp_path):
    folder = write_tar_shards(tmp_path / "few", shards=1, per_shard=8, grey_step=GREY_STEP)
    batches = batches_for(folder, workers=2)
    assert sorted(ids(next(batches)) + ids(next(batches))) == list(range(8))


def test_cli_streaming_with_two_workers_resumes_bit_exactly(tiny_recipe, tmp_path, shards):
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=2, max_train_samples=None)
    flags = ["--train_data_files", f"{shards}/train-*.tar", "--streaming", "--shuffle_buffer_size", 0,
             "--dataloader_num_workers", 2, "--max_train_steps", 10]  # 8 batches per epoch: crosses it
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_training(recipe, straight, *flags)
    train_segment(recipe, resumed, *flags, stop=6)
    with open(os.path.join(resumed, "checkpoint-6", "rank_state_0.json")) as fh:
        assert json.load(fh)["num_workers"] == 2
    run_training(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, resumed, 10)


def test_stream_position_without_loader_state_is_refused(shards):
    with pytest.raises(DataError, match="new --output_dir"):
        batches_for(shards).load_state_dict({"epoch": 0, "examples_seen": 4, "stream": {}})


# id: (workers, shards, images per shard, --shuffle_buffer_size, steps after which the run is killed)
CLI_RESUMES = {  # 4 images a batch; the race needs two workers restored into the same epoch > 0
    "2-workers-just-after-an-epoch-boundary": (2, 8, 4, 0, (10,)),  # both 4 images into their epoch 1
    "1-worker-at-an-epoch-boundary": (1, 8, 4, 0, (8,)),
    "3-workers-uneven-shares": (3, 8, 4, 0, (12,)),  # 12, 12 and 8 images a worker-epoch
    "more-workers-than-shards": (3, 2, 8, 0, (6,)),  # the third worker has no shard
    "shuffle-buffer-fixed-seed": (2, 8, 4, 8, (10,)),
    "2-workers-killed-twice": (2, 8, 4, 0, (5, 10)),
    "2-ranks-2-workers-just-after-an-epoch-boundary": (2, 8, 4, 0, (5,), 2),  # 4 shards a rank, 8 images a worker
}


def train_segment(recipe, output_dir, *flags, stop=None, race=False, ranks=1):
    """One segment of a run: in this process, or with ranks > 1 as that many processes (launch). It
    dies right after checkpoint `stop` (faults.hooks(stop_after_checkpoint=...); in this process
    faults.ProcessDied, which the trainer does not catch); race=True: datasets' set_epoch waits
    between its read and its write of the shared epoch (faults.slow_set_epoch), patched before the
    loader workers fork, so workers restored together race on it."""
    if ranks > 1:
        named = (*(("--stop_after_checkpoint", stop) if stop else ()), *(("--slow_set_epoch", 0.3) if race else ()))
        launch_training(recipe, output_dir, *flags, ranks=ranks, env={"ACCELERATE_USE_CPU": "1"}, faults=named)
        return
    with pytest.MonkeyPatch.context() as patch:
        if race:
            patch.setattr(datasets.IterableDataset, "set_epoch", faults.slow_set_epoch(0.3))
        if stop is None:
            run_training(recipe, output_dir, *flags)
            return
        with pytest.raises(faults.ProcessDied):
            run_training(recipe, output_dir, *flags, hooks=faults.hooks(stop_after_checkpoint=stop))
    later = [name for name in os.listdir(output_dir) if name.startswith("checkpoint-") and int(name[11:]) > stop]
    assert not later and not os.path.exists(os.path.join(output_dir, "unet")), later  # it died at `stop`


@pytest.mark.parametrize("case", CLI_RESUMES.values(), ids=CLI_RESUMES.keys())
def test_cli_streamed_resume_is_bit_exact_across_epoch_boundaries(tiny_recipe, tmp_path, case):
    """Killed after each checkpoint in `stops` and resumed while the workers race on datasets'
    shared epoch (train_segment): the same final weights as a straight run. One rank in this
    process, two as processes."""
    workers, shard_count, per_shard, buffer, stops, ranks = (*case, 1)[:6]
    folder = write_tar_shards(tmp_path / "shards", shards=shard_count, per_shard=per_shard, grey_step=GREY_STEP)
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=math.gcd(*stops), max_train_samples=None)
    flags = ["--train_data_files", f"{folder}/train-*.tar", "--streaming", "--shuffle_buffer_size", buffer,
             "--dataloader_num_workers", workers, "--max_train_steps", 16, "--seed", 3]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_segment(recipe, straight, *flags, ranks=ranks)
    train_segment(recipe, resumed, *flags, stop=stops[0], ranks=ranks)
    for stop in stops[1:] + (None,):
        train_segment(recipe, resumed, *flags, "--resume_from_checkpoint", "latest", stop=stop,
                      race=True, ranks=ranks)
    a, b = load_unet_weights(straight), load_unet_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "final UNet weights differ"
    assert [h["loss"] for h in read_history(straight)] == [h["loss"] for h in read_history(resumed)]
