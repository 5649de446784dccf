"""Streaming decoded in DataLoader workers (torchdata's StatefulDataLoader over datasets'
IterableDataset): rank x worker shards cover every example once per epoch, and a saved position
resumes at the exact example, with 0 or 2 workers."""
import json
import os

import pytest
import torch

from diffusion_extras.data import streaming
from diffusion_extras.training.config import TrainConfig
from diffusion_extras.data.images import DataError
from test_data_files import write_tar_shards
from test_resume import assert_same_state

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


def test_resume_with_another_worker_count_is_refused_naming_the_flag(shards):
    original = batches_for(shards, workers=2)
    next(original)
    with pytest.raises(DataError, match="--dataloader_num_workers 2"):
        batches_for(shards, workers=0).load_state_dict(original.state_dict())


def test_more_workers_than_shards_still_serve_every_example(tmp_path):
    folder = write_tar_shards(tmp_path / "few", shards=1, per_shard=8, grey_step=GREY_STEP)
    batches = batches_for(folder, workers=2)
    assert sorted(ids(next(batches)) + ids(next(batches))) == list(range(8))


def test_cli_streaming_with_two_workers_resumes_bit_exactly(hooked_train, tiny_recipe, tmp_path, shards):
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=2, max_train_samples=None)
    flags = ["--train_data_files", f"{shards}/train-*.tar", "--streaming", "--shuffle_buffer_size", 0,
             "--dataloader_num_workers", 2, "--max_train_steps", 10]  # 8 batches per epoch: crosses it
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    hooked_train(recipe, straight, *flags)
    hooked_train(recipe, resumed, *flags, env={"DDPM_TEST_STOP_AFTER_STEP": "6"})
    with open(os.path.join(resumed, "checkpoint-6", "rank_state_0.json")) as fh:
        assert json.load(fh)["num_workers"] == 2
    hooked_train(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, resumed, 10)


def test_stream_position_without_loader_state_is_refused(shards):
    with pytest.raises(DataError, match="new --output_dir"):
        batches_for(shards).load_state_dict({"epoch": 0, "examples_seen": 4, "stream": {}})
