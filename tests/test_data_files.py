"""--train_data_files: webdataset .tar shards and parquet files, through datasets' own builders,
cached or streamed; shards written by the tests."""
import os

import datasets
import numpy as np
import pytest
from helpers import run_training, write_tar_shards
from PIL import Image

from diffusion_extras.data import decode_cache, streaming
from diffusion_extras.data import images as data
from diffusion_extras.training.config import TrainConfig


def write_parquet(path, count=12):
    """A parquet file whose `image` column holds PNG bytes (grey value 10*i)."""
    features = datasets.Features({"image": datasets.Image(), "n": datasets.Value("int64")})
    images = [Image.fromarray(np.full((10, 12), 10 * i, np.uint8)) for i in range(count)]
    datasets.Dataset.from_dict({"image": images, "n": list(range(count))}, features=features).to_parquet(str(path))
    return str(path)


def ids(images):
    """Image ids from the grey level of centre-cropped constant images (JPEG is exact to +-2)."""
    return sorted(int(round(float(np.mean(image)) / 10)) for image in images)


def test_expand_braces():
    assert data.expand_braces("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert data.expand_braces("{x,y}-{8..10}") == ["x-8", "x-9", "x-10", "y-8", "y-9", "y-10"]
    assert data.expand_braces("plain-*.tar") == ["plain-*.tar"]


@pytest.mark.parametrize("extension", ["jpg", "png"])
def test_tar_shards_load_cached_by_brace_list_and_glob(tmp_path, extension):
    folder = write_tar_shards(tmp_path / "shards", extension=extension)
    for spec in (f"{folder}/train-{{000..002}}.tar", f"{folder}/train-00[01].tar {folder}/train-002.tar"):
        config = TrainConfig(train_data_files=spec, cache_dir=str(tmp_path / "cache"))
        dataset = data.load_image_dataset(config)
        assert len(dataset) == 12
        column = data.find_image_column(dataset)
        images = decode_cache.decode_dataset(dataset, column, 8, True, 1)
        assert ids(images.image(i) for i in range(len(images))) == list(range(12))
    assert os.listdir(tmp_path / "cache")  # datasets' arrow cache went where --cache_dir says


def test_tar_shards_stream_every_image_once(tmp_path):
    folder = write_tar_shards(tmp_path / "shards")
    config = TrainConfig(train_data_files=f"{folder}/train-*.tar", streaming=True, shuffle_buffer_size=0,
                         resolution=8)
    stream, column = streaming.load_stream(config, 0, 1)
    assert column == "jpg"  # webdataset names columns by extension
    batches = streaming.StreamingBatches(stream, column, 4, 8, True, 1, seed=0)
    assert ids(image for _ in range(3) for image in next(batches).numpy()) == list(range(12))
    assert batches.epoch == 0 and batches.examples_seen == 12


def test_parquet_data_files_cached_and_streamed(tmp_path):
    path = write_parquet(tmp_path / "images.parquet")
    cached = data.load_image_dataset(TrainConfig(train_data_files=path, cache_dir=str(tmp_path / "c")))
    decoded = decode_cache.decode_dataset(cached, "image", 8, True, 1)
    assert ids(decoded.image(i) for i in range(12)) == list(range(12))
    stream, column = streaming.load_stream(TrainConfig(train_data_files=path, streaming=True, shuffle_buffer_size=0,
                                                       resolution=8), 0, 1)
    batches = streaming.StreamingBatches(stream, column, 6, 8, True, 1, seed=0)
    assert ids(image for _ in range(2) for image in next(batches).numpy()) == list(range(12))


@pytest.mark.parametrize("spec, message", [
    ("{folder}/nothing-*.tar", "matches no file"),
    ("{folder}/train-000.tar {parquet}", "only .tar shards or only .parquet files"),
])
def test_bad_data_files_are_refused_in_one_line(tmp_path, spec, message):
    folder = write_tar_shards(tmp_path / "shards", shards=1)
    parquet = write_parquet(tmp_path / "x.parquet")
    with pytest.raises(data.DataError, match=message):
        data.load_image_dataset(TrainConfig(train_data_files=spec.format(folder=folder, parquet=parquet)))


def test_cli_trains_on_tar_shards_cached_and_streamed(tiny_recipe, tmp_path):
    folder = write_tar_shards(tmp_path / "shards", shards=4, per_shard=8)
    recipe = tiny_recipe(train_batch_size=4, max_train_samples=None)
    for name, extra in (("cached", []), ("streamed", ["--streaming", "--shuffle_buffer_size", 0])):
        result = run_training(recipe, tmp_path / name, "--train_data_files", f"{folder}/train-{{000..003}}.tar",
                              "--max_train_steps", 2, *extra)
        assert os.path.isfile(tmp_path / name / "unet" / "diffusion_pytorch_model.safetensors"), result.stderr[-800:]
    result = run_training(recipe, tmp_path / "bad", "--train_data_files", f"{folder}/nope-*.tar", "--max_train_steps",
                          2, check=False)
    assert result.returncode == 2 and "--train_data_files" in result.stderr and "matches no file" in result.stderr


def test_one_data_source_at_a_time(tmp_path):
    from diffusion_extras.training.validation import ConfigError, validate
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"")  # validate() checks that local patterns match files
    with pytest.raises(ConfigError, match="not both --dataset_name and --train_data_files"):
        validate(TrainConfig(dataset_name="x", train_data_files=str(shard)))
    validate(TrainConfig(train_data_files=str(shard), streaming=True, max_train_steps=2))  # a source for streaming
