"""Streaming data (local parquet in streaming mode), 1 and 2 ranks, with exact resume. A streamed
run stopped and resumed on 2 ranks, killed and preempted: tests/test_preemption.py and
tests/test_stream_workers.py."""
import numpy as np
import pytest
from helpers import run_training
from PIL import Image

from diffusion_extras.data import streaming
from diffusion_extras.training.config import TrainConfig


def batches_for(folder, rank=0, world=1, buffer=0, batch=4):
    config = TrainConfig(dataset_name=folder, streaming=True, shuffle_buffer_size=buffer, resolution=8)
    stream, column = streaming.load_stream(config, rank, world)
    assert column == "img"
    return streaming.StreamingBatches(stream, column, batch, 8, True, 1, seed=0)


def ids(batch):
    return [int(round(v / 5)) for v in batch[:, 0, 0, 0].tolist()]  # centre-cropped constant images


def test_stream_order_covers_all_and_cycles(parquet_images):
    batches = batches_for(parquet_images, buffer=8)
    seen = [i for _ in range(10) for i in ids(next(batches))]
    assert sorted(seen) == list(range(40))
    assert seen != list(range(40))  # shuffled by the buffer
    next(batches)
    assert batches.epoch == 1 and batches.examples_seen == 44


def test_ranks_get_disjoint_shards(parquet_images):
    first0 = batches_for(parquet_images, 0, 2)
    first1 = batches_for(parquet_images, 1, 2)
    a = [i for _ in range(5) for i in ids(next(first0))]
    b = [i for _ in range(5) for i in ids(next(first1))]
    assert not set(a) & set(b) and sorted(a + b) == list(range(40))


def test_state_dict_resumes_exactly_without_shuffle_buffer(parquet_images):
    original = batches_for(parquet_images, buffer=0)
    for _ in range(3):
        next(original)
    state = original.state_dict()
    expected = [ids(next(original)) for _ in range(4)]
    resumed = batches_for(parquet_images, buffer=0)
    resumed.load_state_dict(state)
    assert [ids(next(resumed)) for _ in range(4)] == expected


def test_state_dict_with_shuffle_buffer_continues_without_repeats(parquet_images):
    """datasets restores the stream position, not the buffer: the examples waiting in the buffer
    at the checkpoint are skipped for the rest of that epoch, none is seen twice."""
    original = batches_for(parquet_images, buffer=8)
    before = [i for _ in range(3) for i in ids(next(original))]
    resumed = batches_for(parquet_images, buffer=8)
    resumed.load_state_dict(original.state_dict())
    after = []
    while True:
        batch = ids(next(resumed))
        if resumed.epoch > 0:
            break
        after += batch
    assert not set(before) & set(after) and len(after) == len(set(after))  # nothing seen twice in the epoch
    assert 40 - len(before) - 8 <= len(after) <= 40 - len(before)  # at most one buffer's worth skipped


def test_corrupt_streamed_image_is_skipped_and_named(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(6):
        Image.fromarray(np.full((8, 8, 3), i * 30, np.uint8)).save(folder / f"{i}.png")
    (folder / "00-bad.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    config = TrainConfig(train_data_dir=str(folder), streaming=True, shuffle_buffer_size=0, resolution=8)
    stream, column = streaming.load_stream(config, 0, 1)
    batches = streaming.StreamingBatches(stream, column, 6, 8, True, 3, seed=0)
    with pytest.warns(UserWarning, match="00-bad.png"):
        batch = next(batches)
    assert batch.shape == (6, 3, 8, 8)


def test_streaming_without_data_flag_is_refused(tiny_recipe, tmp_path):
    result = run_training(tiny_recipe(), tmp_path / "run", "--streaming", check=False)
    assert result.returncode == 2 and "--streaming needs --dataset_name or --train_data_dir" in result.stderr


class RankOf2:
    """accelerate's process-state fields the data sources read, for rank `process_index` of 2."""
    num_processes, is_local_main_process = 2, True

    def __init__(self, process_index):
        import torch
        self.process_index, self.device = process_index, torch.device("cpu")


def test_every_rank_judges_the_streams_channels_and_depth_by_the_same_first_stored_images(tmp_path):
    """A stream's colour channels and pixel depth come from its first 16 images in stored order (as
    cached data's come from its first rows), on every rank: not from the rank's own shard, which
    would give rank 0 (shards 0, 2: 16-bit grayscale) one model and rank 1 (shards 1, 3: 8-bit RGB)
    another. Read unshuffled, that peek also skips the 5-s sleep that ends each iteration of a
    shuffled parquet stream in datasets."""
    import datasets

    from diffusion_extras.data import sources
    folder = tmp_path / "pq"
    folder.mkdir()
    grey16 = [Image.fromarray(np.full((8, 8), 1000 * i, np.uint16)) for i in range(16)]
    rgb8 = [Image.fromarray(np.full((8, 8, 3), i, np.uint8)) for i in range(16)]
    for k, images in enumerate([grey16, rgb8, grey16, rgb8]):
        datasets.Dataset.from_dict({"img": images}, features=datasets.Features({"img": datasets.Image()})) \
            .to_parquet(str(folder / f"part-{k}.parquet"))
    spec = TrainConfig(dataset_name=str(folder), streaming=True, shuffle_buffer_size=8, resolution=8,
                       max_train_steps=1).data_spec()
    for rank in (0, 1):
        firsts, channels, _ = sources.open_training_data(spec, RankOf2(rank))
        assert channels == 1, rank
        assert sources.build_source(spec, RankOf2(rank), channels, firsts).pixels.dtype == "uint16", rank
        assert sources.build_source(spec, RankOf2(rank), channels).pixels.dtype == "uint16", rank  # peeks itself
