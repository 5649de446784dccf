"""Image conditions in the data (data/conditioning.py): random inpainting masks from seeds, and
stored conditions (a column, a paired folder; cached or streamed) that reach the UNet paired with
their image through crops and flips."""
import os

import numpy as np
import pytest
import torch
from helpers import first_step_inputs, paired_images, run_training, write_paired_folders, write_paired_parquet
from PIL import Image

from diffusion_extras.data import conditioning
from diffusion_extras.training.conditioning import ImageCondition


def test_random_masks_are_a_function_of_their_seed_and_of_every_kind():
    first = [conditioning.random_mask(16, 24, seed) for seed in range(200)]
    again = [conditioning.random_mask(16, 24, seed) for seed in range(200)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert all(mask.shape == (16, 24) and mask.dtype == bool for mask in first)
    fractions = np.array([mask.mean() for mask in first])
    assert (fractions > 0).all() and (fractions < 1).all()
    halves = [mask for mask in first if mask.mean() == 0.5 and (mask.all(0) | ~mask.any(0)).all()
              or mask.mean() == 0.5 and (mask.all(1) | ~mask.any(1)).all()]
    rectangles = [mask for mask in first if _is_rectangle(mask) and mask.mean() != 0.5]
    assert len(halves) > 20 and len(rectangles) > 40 and len(first) - len(halves) - len(rectangles) > 40  # strokes
    others = [mask for mask in first if mask.mean() != 0.5]
    assert len({mask.tobytes() for mask in others}) > 0.95 * len(others)  # drawn, not repeated


def _is_rectangle(mask: np.ndarray) -> bool:
    rows, columns = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    return mask[rows[0]:rows[-1] + 1, columns[0]:columns[-1] + 1].all()


def test_each_rank_draws_the_masks_of_its_images_of_the_global_batch():
    """The mask of image i of a micro-step's global batch is seeded by (seed, micro-step, i): rank r
    of P, B images each, draws those of images rB..rB+B-1, as one rank of PB does."""
    condition = ImageCondition("inpainting", 1, 0, 2, seed=5)
    whole = condition.mask_seeds(7, 0, 8)
    assert condition.mask_seeds(7, 4, 4) == whole[4:] and condition.mask_seeds(7, 0, 4) == whole[:4]
    assert condition.mask_seeds(8, 0, 8) != whole
    assert ImageCondition("inpainting", 1, 0, 2, seed=6).mask_seeds(7, 0, 8) != whole


@pytest.mark.usefixtures("fresh_accelerate")
def test_random_masks_reach_the_unet_with_the_image_they_mask(tmp_path):
    """Inpainting with random masks on the digits: after x_t the UNet sees the binary mask, then the
    image with the masked pixels at 0."""
    cleans, inputs = first_step_inputs(tmp_path, "--conditioning", "inpainting")
    unet_input, clean = inputs[0], cleans[0]
    assert unet_input.shape == (8, 3, 8, 8)
    mask = unet_input[:, 1:2]
    assert set(mask.unique().tolist()) == {0.0, 1.0} and 0 < mask.mean() < 1
    torch.testing.assert_close(unet_input[:, 2:], clean * (1 - mask))


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("streaming", [False, True])
def test_a_mask_column_reaches_the_unet_cropped_and_flipped_with_its_image(tmp_path, streaming):
    """Masks in a column of a parquet file, random 8 px crops of 8 x 12 images and flips: the mask
    channel the UNet sees is, for every image, the same crop and flip of its mask (here, by
    construction, white where the image is bright: the pair recomputed from the clean image)."""
    images, masks = paired_images(16, 8, 12)  # the size that covers 8 x 8: cropped, not resized
    data = write_paired_parquet(tmp_path / "pairs.parquet", images, masks, "m")
    flags = ["--train_data_files", data, "--conditioning", "inpainting", "--mask_column", "m", "--no-center_crop",
             "--random_flip", "--resolution", 8] + (["--streaming", "--max_train_steps", 1] if streaming else [])
    cleans, inputs = first_step_inputs(tmp_path, *flags, max_train_samples=None)
    clean, mask = cleans[0], inputs[0][:, 1:2]
    assert torch.equal(mask, (clean > 0).float())
    torch.testing.assert_close(inputs[0][:, 2:], clean * (1 - mask))


@pytest.mark.usefixtures("fresh_accelerate")
def test_paired_folders_reach_the_unet_as_pairs(tmp_path):
    """Image-to-image on --train_data_dir and --conditioning_data_dir: each image's pair is the file
    at the same relative path, of another extension; the UNet sees it after x_t."""
    images, masks = paired_images(16, 8, 8, seed=1)
    image_dir, pair_dir = write_paired_folders(tmp_path / "data", images, masks)
    cleans, inputs = first_step_inputs(tmp_path, "--train_data_dir", image_dir, "--conditioning", "image",
                                       "--conditioning_data_dir", pair_dir, "--random_flip", max_train_samples=None)
    assert inputs[0].shape == (8, 2, 8, 8)
    assert torch.equal(inputs[0][:, 1:], torch.where(cleans[0] > 0, 1.0, -1.0))


def test_an_image_without_its_pair_is_refused_naming_it(tmp_path, tiny_recipe):
    images, masks = paired_images(4, 8, 8)
    image_dir, mask_dir = write_paired_folders(tmp_path / "data", images, masks)
    (tmp_path / "data" / "pairs" / "1" / "3.bmp").unlink()
    result = run_training(tiny_recipe(max_train_samples=None), tmp_path / "run", "--train_data_dir", image_dir,
                          "--conditioning", "inpainting", "--mask_data_dir", mask_dir, "--max_train_steps", 1,
                          check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "1 image(s) of" in last and "3.png" in last and "give every image its pair" in last


def test_a_condition_column_that_is_missing_or_not_images_is_refused(tmp_path, tiny_recipe):
    images, masks = paired_images(4, 8, 8)
    data = write_paired_parquet(tmp_path / "pairs.parquet", images, masks, "m")
    for column, message in (("mask", "--mask_column mask is not in the dataset (columns: image, m)"),):
        result = run_training(tiny_recipe(max_train_samples=None), tmp_path / "run", "--train_data_files", data,
                              "--conditioning", "inpainting", "--mask_column", column, "--max_train_steps", 1,
                              check=False)
        assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]


def test_a_pair_with_two_files_of_one_name_is_refused_naming_both(tmp_path, tiny_recipe):
    """A paired folder holding 3.bmp and 3.jpg: either could be image 3's mask; the trainer refuses
    before training, naming both files, and the commands' --masks pairing refuses the same."""
    from diffusion_extras.cli.common import paired_paths

    images, masks = paired_images(4, 8, 8)
    image_dir, mask_dir = write_paired_folders(tmp_path / "data", images, masks)
    Image.fromarray(masks[3]).save(tmp_path / "data" / "pairs" / "1" / "3.jpg")
    result = run_training(tiny_recipe(max_train_samples=None), tmp_path / "run", "--train_data_dir", image_dir,
                          "--conditioning", "inpainting", "--mask_data_dir", mask_dir, "--max_train_steps", 1,
                          check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"--mask_data_dir {mask_dir}" in last and "3.bmp" in last and "3.jpg" in last and "keep one" in last
    paths = sorted(str(path) for path in (tmp_path / "data" / "images").rglob("*.png"))
    with pytest.raises(ValueError, match=r"3\.bmp and .*3\.jpg .*keep one"):
        paired_paths(paths, image_dir, mask_dir, "--masks")
    Image.fromarray(images[1]).save(tmp_path / "data" / "images" / "1" / "1.tif")  # two images that one mask pairs
    (tmp_path / "data" / "pairs" / "1" / "3.jpg").unlink()
    with pytest.raises(ValueError, match=r"1\.png and .*1\.tif .*--masks pairs a file by its name"):
        paired_paths(sorted(str(p) for p in (tmp_path / "data" / "images").rglob("*.*")), image_dir, mask_dir,
                     "--masks")


def test_the_trainer_the_paired_folders_and_the_commands_read_the_same_files(tmp_path):
    """One list of image extensions: the files datasets' imagefolder reads for --train_data_dir (a
    TIFF and an upper-case .PNG among them, not a PDF that Pillow would open), the files a paired
    folder pairs and the files a command's folder lists are the same."""
    import datasets

    from diffusion_extras.cli.common import list_images
    from diffusion_extras.data import pairs

    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("0.png", "1.tif", "2.PNG", "3.webp", "4.jpeg"):
        Image.fromarray(np.full((4, 4), 9, np.uint8)).save(folder / name)
    Image.fromarray(np.full((4, 4), 9, np.uint8)).save(folder / "5.pdf")
    (folder / "notes.txt").write_text("not an image")
    trainer = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    read = sorted(os.path.basename(row["path"]) for row in trainer.cast_column("image", datasets.Image(decode=False))
                  ["image"])
    assert read == ["0.png", "1.tif", "2.PNG", "3.webp", "4.jpeg"]
    assert sorted(os.path.basename(path) for path in pairs.image_files(str(folder), "--masks").values()) == read
    assert [os.path.basename(path) for path in list_images(str(folder))] == read


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("form", ["0/1", "16-bit 0/65535", "twice the size"])
def test_a_mask_folder_reaches_the_unet_as_the_mask_it_stores_in_any_form(tmp_path, form):
    """--mask_data_dir of masks saved 0/1 (how segmentation masks are saved: read as 0/255 they
    masked nothing), in 16 bits, or at twice their image's size (resized as the pipeline resizes a
    mask): the UNet's mask channel is each image's mask (white where the image is bright)."""
    images, masks = paired_images(16, 8, 8, seed=3)
    stored = {"0/1": masks // 255, "16-bit 0/65535": (masks // 255).astype(np.uint16) * 65535,
              "twice the size": np.kron(masks, np.ones((2, 2), np.uint8))}[form]
    image_dir, mask_dir = write_paired_folders(tmp_path / "data", images, stored, pair_extension=".png")
    cleans, inputs = first_step_inputs(tmp_path, "--train_data_dir", image_dir, "--conditioning", "inpainting",
                                       "--mask_data_dir", mask_dir, "--random_flip", max_train_samples=None)
    mask = inputs[0][:, 1:2]
    assert 0 < mask.mean() < 1
    assert torch.equal(mask, (cleans[0] > 0).float())


def test_masks_the_rule_cannot_read_as_meant_are_refused_before_training(tmp_path, tiny_recipe):
    """A mask folder of label maps (classes 0, 1, 2: nothing reaches half) is one line naming the
    first file, before training (not a run of skipped rows)."""
    images, masks = paired_images(8, 8, 8)
    image_dir, mask_dir = write_paired_folders(tmp_path / "data", images, (masks // 255) * 2 + 0,
                                               pair_extension=".png")
    result = run_training(tiny_recipe(max_train_samples=None), tmp_path / "run", "--train_data_dir", image_dir,
                          "--conditioning", "inpainting", "--mask_data_dir", mask_dir, "--train_batch_size", 4,
                          "--max_train_steps", 1, check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "0.png: its values reach 2 of 255 and none reaches half" in last and "a label map?" in last


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("streaming", [False, True])
def test_16_bit_conditioning_images_keep_their_depth_beside_8_bit_images(tmp_path, streaming):
    """Image-to-image with 8-bit images and 16-bit conditioning PNGs: the pair's depth is judged
    from both (images.stored_format), so the UNet sees each condition at 16 bits (here image x 256
    + 128, no 8-bit level), cached or streamed; judged from the images alone it was rounded to 8."""
    images, _ = paired_images(16, 8, 8, seed=4)
    conditions = images.astype(np.uint16) * 256 + 128
    image_dir, condition_dir = write_paired_folders(tmp_path / "data", images, conditions, pair_extension=".png")
    flags = ["--train_data_dir", image_dir, "--conditioning", "image", "--conditioning_data_dir", condition_dir,
             *(["--streaming", "--max_train_steps", 1] if streaming else [])]
    cleans, inputs = first_step_inputs(tmp_path, *flags, max_train_samples=None)
    image = torch.round((cleans[0].double() + 1) / 2 * 255)
    expected = (image * 256 + 128) / 65535 * 2 - 1
    torch.testing.assert_close(inputs[0][:, 1:].double(), expected, atol=1e-5, rtol=0)


def test_a_transparent_conditioning_image_is_composited_on_the_background_as_images_are(tmp_path):
    """decode_pair decodes a conditioning image as an image (images.preprocess_image): an RGBA
    condition beside grey images is composited on --background (here black), then made grey."""
    from diffusion_extras.data.images import PixelFormat

    grey = np.full((8, 8), 90, np.uint8)
    rgba = np.dstack([np.full((8, 8, 3), 200, np.uint8), np.where(np.arange(8) < 4, 0, 255).astype(np.uint8)[None]
                      .repeat(8, 0)])
    Image.fromarray(grey).save(tmp_path / "image.png")
    Image.fromarray(rgba).save(tmp_path / "condition.png")
    items = [{"path": str(tmp_path / name), "bytes": None} for name in ("image.png", "condition.png")]
    pair = conditioning.decode_pair(*items, 8, True, 1, conditioning.StoredCondition("c", mask=False),
                                    PixelFormat("uint8", (0, 0, 0)))
    assert pair.shape == (8, 8, 2) and (pair[..., 0] == 90).all()
    assert (pair[:, :4, 1] == 0).all() and (pair[:, 4:, 1] == 200).all()
