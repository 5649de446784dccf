"""Tests for diffusion_extras/evaluation/sampling.py and the `python -m diffusion_extras.sample` command line."""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from helpers import run_cli, save_tiny_pipeline, tiny_unet
from PIL import Image

from diffusion_extras.evaluation.sampling import SCHEDULERS, generate, image_grid, make_scheduler, save_images


class ScaledIdentityUNet(torch.nn.Module):
    """Predicts 0.5 * x_t: only elementwise ops, so it is exactly batch-invariant (unlike conv/GEMM kernels)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(sample_size=6, in_channels=3, out_channels=3)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, sample, timestep):
        return SimpleNamespace(sample=sample * self.scale)




@pytest.fixture(scope="module")
def unet():
    return tiny_unet(channels=3)


@pytest.fixture(scope="module")
def training_scheduler():
    return DDPMScheduler(num_train_timesteps=100)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_generate_is_seeded_uint8_and_leaves_global_state(unet, training_scheduler, name):
    scheduler = make_scheduler(name, training_scheduler.config)
    unet.train()
    unet.mid_block.eval()  # a mixed-mode model must come back exactly as it was
    modes = [module.training for module in unet.modules()]
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    first = generate(unet, scheduler, num_images=4, num_inference_steps=8, seed=3)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert numpy_state[1].tolist() == np.random.get_state()[1].tolist()
    assert [module.training for module in unet.modules()] == modes
    assert first.shape == (4, 8, 8, 3) and first.dtype == np.uint8
    assert first.std() > 0 and len({image.tobytes() for image in first}) == 4
    np.testing.assert_array_equal(generate(unet, scheduler, 4, 8, seed=3), first)
    assert not np.array_equal(generate(unet, scheduler, 4, 8, seed=4), first)


def test_generate_does_not_step_the_callers_scheduler(unet, training_scheduler):
    timesteps = training_scheduler.timesteps.clone()
    generate(unet, training_scheduler, num_images=1, num_inference_steps=5)
    assert torch.equal(training_scheduler.timesteps, timesteps)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_noise_depends_only_on_seed_and_image_index(training_scheduler, name):
    model = ScaledIdentityUNet()
    scheduler = make_scheduler(name, training_scheduler.config)
    whole = generate(model, scheduler, num_images=5, num_inference_steps=6, seed=1)
    for batch_size in (1, 2, 3):
        np.testing.assert_array_equal(generate(model, scheduler, 5, 6, seed=1, batch_size=batch_size), whole)
    np.testing.assert_array_equal(generate(model, scheduler, 2, 6, seed=1, start_index=3), whole[3:])


@pytest.mark.parametrize("name", SCHEDULERS)
def test_real_unet_batch_size_changes_images_at_most_by_rounding(unet, training_scheduler, name):
    # CPU conv/GEMM kernels are chosen by batch size, so the UNet's outputs differ by ~1e-7 between
    # batch sizes (measured); exactness is tested above with a batch-invariant model. Here (8 steps)
    # what remains must be float rounding: at most one uint8 level, on few pixels. Beware: a long
    # deterministic run of an untrained net can amplify it (DDIM, clip_sample, 50 of 1000 steps: up
    # to 22 levels, measured), so compare metrics at one fixed batch size.
    scheduler = make_scheduler(name, training_scheduler.config)
    whole = generate(unet, scheduler, 6, 8, seed=5).astype(int)
    split = generate(unet, scheduler, 6, 8, seed=5, batch_size=2).astype(int)
    assert np.abs(whole - split).max() <= 1
    assert (whole != split).mean() < 0.02


def test_image_grid_places_images_row_major_with_padding():
    images = np.stack([np.full((4, 3, 3), 10 * (index + 1), np.uint8) for index in range(5)])
    grid = np.asarray(image_grid(images))
    assert grid.shape == (2 + 2 * 6, 2 + 3 * 5, 3)  # 5 images -> 3 per row, 2 rows, 2 px padding
    assert (grid[8:12, 7:10] == 50).all()  # image 4: second row, second column
    assert (grid[:2] == 0).all() and (grid[:, 5:7] == 0).all()
    assert (grid[8:12, 12:15] == 0).all()  # the empty sixth cell
    assert image_grid(images[..., :1]).mode == "L"


def test_save_images_writes_numbered_pngs_and_grid(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (3, 5, 5, 3), dtype=np.uint8)
    paths = save_images(images, str(tmp_path / "out"))
    assert [os.path.basename(path) for path in paths] == ["000000.png", "000001.png", "000002.png", "grid.png"]
    for image, path in zip(images, paths):
        np.testing.assert_array_equal(np.asarray(Image.open(path)), image)


def test_cli_bad_input_is_one_line_error_exit_2(tmp_path):
    result = run_cli(["-m", "diffusion_extras.sample", str(tmp_path / "nope"), "--output", str(tmp_path / "out")],
                     check=False)
    assert result.returncode == 2
    error = result.stderr.strip()
    assert error.startswith("error: ") and "does not exist" in error and "\n" not in error


def test_cli_writes_pngs_and_grid(tmp_path):
    pipeline_dir = save_tiny_pipeline(tmp_path / "run", channels=1)
    output = tmp_path / "samples"
    run_cli(["-m", "diffusion_extras.sample", pipeline_dir, "--num_images", "5", "--scheduler", "dpm",
             "--num_inference_steps", "4", "--batch_size", "2", "--output", str(output), "--device", "cpu"])
    assert sorted(os.listdir(output)) == [f"{index:06d}.png" for index in range(5)] + ["grid.png"]
    assert Image.open(output / "000004.png").size == (8, 8)
    assert Image.open(output / "grid.png").size == (2 + 3 * 10, 2 + 2 * 10)


def option_help(help_text: str, flag: str) -> str:
    """The help of `flag` in argparse's --help output: its line and the indented lines after it, one-spaced."""
    lines = help_text.splitlines()
    start = next(index for index, line in enumerate(lines) if line.strip().startswith(flag + " "))
    end = next((index for index in range(start + 1, len(lines)) if lines[index].strip().startswith("-")), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize("command, defaults", [
    ("diffusion_extras.sample", {"--num_images": 16, "--scheduler": "ddim, euler for a flow-matching model",
                                 "--num_inference_steps": 50, "--seed": 0, "--batch_size": 16, "--dtype": "fp32",
                                 "--device": "auto"}),
    ("diffusion_extras.evaluate", {"--scheduler": "ddim, euler for a flow-matching model", "--num_inference_steps": 50,
                                   "--seed": 0})])
def test_cli_help_says_what_each_sampling_flag_does_and_its_default(command, defaults):
    result = run_cli(["-m", command, "--help"])
    assert result.returncode == 0
    for flag, default in defaults.items():
        text = option_help(result.stdout, flag)
        assert f"(default: {default})" in text and len(text.split()) > 6, text  # words beside the default
