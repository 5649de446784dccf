import os

import datasets
import numpy as np
import pytest
import torch
from helpers import run_cli
from PIL import Image

from diffusion_extras.data import batch_order, decode_cache
from diffusion_extras.data import images as data
from diffusion_extras.training.config import TrainConfig


def config(**kw):
    return TrainConfig(**kw)


def test_digits_default_is_a_datasets_image_dataset():
    dataset = data.load_image_dataset(config())
    assert len(dataset) == 1797
    assert isinstance(dataset.features["image"], datasets.Image)
    first = dataset[0]["image"]
    assert first.size == (8, 8) and first.mode == "L"
    pixels = np.stack([np.asarray(image) for image in dataset["image"]])
    levels = {round(k * 255 / 16) for k in range(17)}  # 16 grey levels scaled to the full range
    assert set(np.unique(pixels).tolist()) <= levels and pixels.max() == 255
    from sklearn.datasets import load_digits
    digits = load_digits()  # every image and label as scikit-learn has it, in its order
    assert np.array_equal(pixels, (digits.images * (255 / 16)).round().astype(np.uint8))
    assert dataset["label"] == digits.target.tolist()


def test_find_image_column_auto_and_errors():
    dataset = datasets.Dataset.from_dict(
        {"caption": ["a"], "picture": [Image.new("RGB", (4, 4))]},
        features=datasets.Features({"caption": datasets.Value("string"), "picture": datasets.Image()}))
    assert data.find_image_column(dataset) == "picture"
    with pytest.raises(data.DataError, match="--image_column photo is not in the dataset"):
        data.find_image_column(dataset, "photo")
    with pytest.raises(data.DataError, match="--image_column caption holds"):
        data.find_image_column(dataset, "caption")
    with pytest.raises(data.DataError, match="no image column"):
        data.find_image_column(datasets.Dataset.from_dict({"x": [1]}))


def _image_folder(path, count=6, size=(12, 10)):
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(path, f"{i}.png"))
    return str(path)


def test_sources_image_folder_saved_dataset_and_loadable_folder(tmp_path):
    folder = _image_folder(tmp_path / "imgs")
    from_folder = data.load_image_dataset(config(train_data_dir=folder, cache_dir=str(tmp_path / "c")))
    assert len(from_folder) == 6 and data.find_image_column(from_folder) == "image"
    from_folder.save_to_disk(str(tmp_path / "saved"))
    saved = data.load_image_dataset(config(dataset_name=str(tmp_path / "saved")))
    assert len(saved) == 6
    datasets.DatasetDict({"train": from_folder}).save_to_disk(str(tmp_path / "saved_dict"))
    assert len(data.load_image_dataset(config(dataset_name=str(tmp_path / "saved_dict")))) == 6
    # a plain folder of images is something load_dataset understands too
    assert len(data.load_image_dataset(config(dataset_name=folder, cache_dir=str(tmp_path / "c2")))) == 6


def test_max_train_samples_is_seeded_subset():
    a = data.load_image_dataset(config(max_train_samples=10, seed=1))
    b = data.load_image_dataset(config(max_train_samples=10, seed=1))
    assert len(a) == 10 and a["label"] == b["label"]


def test_hub_id_offline_is_a_clear_error(tmp_path):
    """A Hub id offline (as the suite is: HF_HUB_OFFLINE=1 when the libraries were imported): one
    line naming the id and the variable, exit 2, before anything is written."""
    command = ["train_ddpm.py", "--dataset_name", "someone/no-such-dataset", "--output_dir", tmp_path / "run"]
    result = run_cli(command, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: --dataset_name someone/no-such-dataset: could not load it: ")
    assert "(HF_HUB_OFFLINE is set: Hub ids cannot be downloaded; give a local folder)" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode,channels", [("RGB", 1), ("L", 3), ("RGBA", 3), ("P", 3)])
def test_preprocess_modes_resize_and_crops(mode, channels):
    image = Image.new(mode, (40, 20))
    out = data.preprocess_image(image, 8, center_crop=True, channels=channels)
    assert out.shape == (8, 8, channels) and out.dtype == np.uint8
    kept = data.preprocess_image(image, 8, center_crop=False, channels=channels)
    assert kept.shape == (8, 16, channels)  # shorter side to 8; the random crop happens per batch


def test_center_crop_takes_the_middle():
    pixels = np.zeros((8, 24), np.uint8)
    pixels[:, 8:16] = 255
    out = data.preprocess_image(Image.fromarray(pixels), 8, center_crop=True, channels=1)
    assert out.min() == 255


def bands(width: int, height: int, vertical: bool) -> Image.Image:
    """A grayscale image of three equal bands, 0, 128 and 255, left to right (vertical) or top to
    bottom: which values survive a crop shows which part was kept."""
    pixels = np.zeros((height, width), np.uint8)
    for index, value in enumerate((0, 128, 255)):
        if vertical:
            pixels[:, index * width // 3:(index + 1) * width // 3] = value
        else:
            pixels[index * height // 3:(index + 1) * height // 3] = value
    return Image.fromarray(pixels)


@pytest.mark.parametrize("image,resolution,kept", [
    (bands(60, 20, vertical=True), (8, 8), {128}),            # a wide image, a square: its middle band
    (bands(60, 20, vertical=True), (8, 24), {0, 128, 255}),    # the image's own aspect: all of it
    (bands(24, 60, vertical=False), (10, 8), {128}),           # a tall image, a wide-ish target: its middle rows
    (bands(24, 60, vertical=False), (30, 12), {0, 128, 255}),  # the same aspect, half size: all of it
])
def test_a_height_and_width_resize_keeps_the_aspect_and_crops_the_centre(image, resolution, kept):
    out = data.preprocess_image(image, resolution, center_crop=True, channels=1)
    assert out.shape == (*resolution, 1)
    # bicubic blurs the bands' edges: the values well inside the crop say which bands it holds
    inner = out[1:-1, 1:-1, 0] if min(resolution) > 8 else out[2:-2, 2:-2, 0]
    assert {value for value in (0, 128, 255) if np.any(np.abs(inner.astype(int) - value) <= 2)} == kept


def test_without_the_centre_crop_the_image_just_covers_the_resolution_and_the_batch_crops_it():
    # 60x20 (W x H) to 8 x 16 (H x W): the scale max(8 / 20, 16 / 60) = 0.4 gives 24 x 8
    stored = data.preprocess_image(bands(60, 20, vertical=True), (8, 16), center_crop=False, channels=1)
    assert stored.shape == (8, 24, 1)
    # 20x60 to 8 x 16: the width decides, max(8 / 60, 16 / 20) = 0.8, 16 x 48
    assert data.preprocess_image(bands(20, 60, vertical=True), (8, 16), center_crop=False, channels=1).shape == \
        (48, 16, 1)
    crops = {batch_order.random_crop(stored, (8, 16), 0, step).tobytes() for step in range(8)}
    assert all(len(crop) == 8 * 16 for crop in crops) and len(crops) > 1  # placed per step, 8 x 16 each


def test_corrupt_file_skipped_with_warning_naming_it(tmp_path):
    folder = _image_folder(tmp_path / "imgs", count=4)
    with open(os.path.join(folder, "bad.png"), "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\ntruncated")
    dataset = data.load_image_dataset(config(train_data_dir=folder, cache_dir=str(tmp_path / "c")))
    with pytest.warns(UserWarning, match="bad.png"):
        images = decode_cache.decode_dataset(dataset, "image", 8, True, 3)
    assert len(images) == 4


def test_decode_cache_is_reused(tmp_path):
    folder = _image_folder(tmp_path / "imgs", count=5, size=(16, 12))
    dataset = data.load_image_dataset(config(train_data_dir=folder, cache_dir=str(tmp_path / "c")))
    first = decode_cache.cached_decode(dataset, "image", 8, False, 3, str(tmp_path / "cache"))
    [entry] = os.listdir(tmp_path / "cache" / "ddpm_decoded")
    second = decode_cache.cached_decode(dataset, "image", 8, False, 3, str(tmp_path / "cache"))
    assert isinstance(second.pixels, np.memmap)
    for i in range(5):
        assert np.array_equal(first.image(i), second.image(i)) and first.image(i).shape == (8, 11, 3)  # 16x12 -> 11x8
    decode_cache.cached_decode(dataset, "image", 4, False, 3, str(tmp_path / "cache"))
    assert len(os.listdir(tmp_path / "cache" / "ddpm_decoded")) == 2  # another resolution, another entry
    for pair in ((4, 8), (8, 4)):  # both sides are in the key: each order is its own entry
        assert decode_cache.cached_decode(dataset, "image", pair, True, 3, str(tmp_path / "cache")).image(0).shape == \
            (*pair, 3)
    assert len(os.listdir(tmp_path / "cache" / "ddpm_decoded")) == 4


def test_global_batch_order_is_function_of_seed_and_step():
    order = batch_order.GlobalBatchOrder(20, 6, seed=3)
    assert order.batches_per_epoch == 3
    epoch0 = np.concatenate([order.indices(k) for k in range(3)])
    assert len(set(epoch0.tolist())) == 18  # no repeats within an epoch
    again = batch_order.GlobalBatchOrder(20, 6, seed=3)
    assert np.array_equal(again.indices(4), order.indices(4))  # random access, no replay
    assert not np.array_equal(order.indices(3), order.indices(0))  # a new permutation each epoch
    assert order.position(7) == (2, 1)
    with pytest.raises(data.DataError, match="larger than the dataset"):
        batch_order.GlobalBatchOrder(4, 8, 0)


def test_rank_slices_partition_the_global_batch():
    images = decode_cache.DecodedImages(np.arange(10 * 4, dtype=np.uint8), np.array([[2, 2]] * 10),
                                        np.arange(0, 40, 4), 1)
    order = batch_order.GlobalBatchOrder(10, 4, seed=0)
    single = batch_order.MicroBatches(images, order, 0, 4, 2, 0)[1]
    ranks = [batch_order.MicroBatches(images, order, r, 2, 2, 0)[1] for r in (0, 1)]
    assert torch.equal(torch.cat(ranks), single)
    assert single.shape == (4, 1, 2, 2) and single.dtype == torch.uint8


def test_random_crop_is_deterministic_per_step_and_varies():
    pixels = np.arange(6 * 10, dtype=np.uint8)
    images = decode_cache.DecodedImages(pixels, np.array([[6, 10]]), np.array([0]), 1)
    order = batch_order.GlobalBatchOrder(1, 1, seed=0)
    batches = batch_order.MicroBatches(images, order, 0, 1, 6, seed=5)
    crops = [batches[k] for k in range(8)]
    assert torch.equal(crops[2], batch_order.MicroBatches(images, order, 0, 1, 6, seed=5)[2])
    assert len({c.numpy().tobytes() for c in crops}) > 1
    assert all(c.shape == (1, 1, 6, 6) for c in crops)


def test_to_model_input_scales_and_flips():
    batch = torch.tensor([[[[0, 255]]], [[[0, 255]]]], dtype=torch.uint8)
    out = batch_order.to_model_input(batch, "cpu", torch.tensor([False, True]))
    assert out.dtype == torch.float32
    assert out[0].flatten().tolist() == [-1.0, 1.0] and out[1].flatten().tolist() == [1.0, -1.0]


def test_pooled_decoding_equals_in_process_and_names_corrupt_files(tmp_path, monkeypatch):
    folder = _image_folder(tmp_path / "imgs", count=11, size=(14, 10))
    with open(os.path.join(folder, "05-bad.png"), "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\ntruncated")
    dataset = data.load_image_dataset(config(train_data_dir=folder, cache_dir=str(tmp_path / "c")))
    monkeypatch.setattr(decode_cache, "DECODE_CHUNK", 3)  # 12 rows -> 4 tasks
    with pytest.warns(UserWarning, match="05-bad.png"):
        alone = list(decode_cache.iter_decoded(dataset, "image", 8, False, 3, workers=1))
    with pytest.warns(UserWarning, match="05-bad.png"):
        pooled = list(decode_cache.iter_decoded(dataset, "image", 8, False, 3, workers=2))
    assert len(alone) == len(pooled) == 11
    assert all(np.array_equal(a, b) for a, b in zip(alone, pooled))


def test_cache_file_holds_every_image_in_row_order(tmp_path):
    folder = _image_folder(tmp_path / "imgs", count=7, size=(9, 13))
    dataset = data.load_image_dataset(config(train_data_dir=folder, cache_dir=str(tmp_path / "c")))
    cached = decode_cache.cached_decode(dataset, "image", 8, False, 3, str(tmp_path / "cache"))
    direct = decode_cache.decode_dataset(dataset, "image", 8, False, 3)
    [entry] = os.listdir(tmp_path / "cache" / "ddpm_decoded")
    assert os.path.getsize(tmp_path / "cache" / "ddpm_decoded" / entry / "pixels.bin") == direct.pixels.size
    assert all(np.array_equal(cached.image(i), direct.image(i)) for i in range(7))
