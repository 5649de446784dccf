"""Non-square images end to end (--resolution H,W): a pixel run on rectangular images and a latent
run, their exports loaded by diffusers and sampled at height x width, the sample and evaluate
commands, fine-tuning from a non-square export and the resume check. PIL sizes are (width, height)."""
import json

import pytest
import yaml
from helpers import (
    LATENT_MODEL,
    TINY_RECIPE,
    run_cli,
    run_training,
    save_random_images,
    save_tiny_vae,
    tiny_unet,
    write_tiny_recipe,
)
from PIL import Image

HEIGHT, WIDTH = 8, 16


@pytest.fixture(scope="module")
def pixel_run(tmp_path_factory):
    """2 steps of the tiny recipe at 8 x 16 on 12 x 30 RGB images, a grid and a checkpoint at step 2."""
    folder = tmp_path_factory.mktemp("pixel")
    images = save_random_images(folder / "images", 16, 12, 30)
    recipe = write_tiny_recipe(folder, save_images_steps=2, checkpointing_steps=2)
    result = run_training(recipe, folder / "run", "--train_data_dir", images, "--resolution", f"{HEIGHT},{WIDTH}",
                          "--max_train_steps", 2)
    return folder / "run", recipe, images, result.stdout


@pytest.mark.xdist_group("test_nonsquare.pixel_run")
def test_the_pixel_export_samples_height_by_width_with_ddpm_pipeline(pixel_run):
    import torch
    from diffusers import DDPMPipeline
    run, _, _, stdout = pixel_run
    assert "1 channel(s) (grayscale) at 8x16 px" in stdout  # the model line states height x width
    assert json.loads((run / "unet" / "config.json").read_text())["sample_size"] == [HEIGHT, WIDTH]
    assert yaml.safe_load((run / "training_config.yaml").read_text())["resolution"] == [HEIGHT, WIDTH]
    pipe = DDPMPipeline.from_pretrained(run)
    images = pipe(batch_size=2, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images
    assert [image.size for image in images] == [(WIDTH, HEIGHT)] * 2
    # the step-2 grid: 4 images of 16 x 8, 2 a row, 2 px apart and around
    with Image.open(run / "samples" / "step_000002.png") as grid:
        assert grid.size == (2 + 2 * (WIDTH + 2), 2 + 2 * (HEIGHT + 2))
    with Image.open(run / "samples" / "step_000002_raw_vs_ema.png") as debug:  # two such grids side by side
        assert debug.size[1] == 2 + 2 * (HEIGHT + 2) and debug.size[0] > 2 * (2 + 2 * (WIDTH + 2))
    with Image.open(run / "samples" / "step_000002_denoising.png") as strip:  # 2 seeds a row, a row per step
        assert strip.size[0] == 2 + 2 * (WIDTH + 2) and (strip.size[1] - 2) % (HEIGHT + 2) == 0


@pytest.mark.xdist_group("test_nonsquare.pixel_run")
def test_the_sample_and_evaluate_commands_take_a_non_square_export(pixel_run, tmp_path):
    run, _, images, _ = pixel_run
    run_cli(["-m", "diffusion_extras.sample", run, "--num_images", 3, "--num_inference_steps", 2,
             "--output", tmp_path / "samples", "--device", "cpu"])
    with Image.open(tmp_path / "samples" / "000002.png") as image:
        assert image.size == (WIDTH, HEIGHT)
    with Image.open(tmp_path / "samples" / "grid.png") as grid:
        assert grid.size == (2 + 2 * (WIDTH + 2), 2 + 2 * (HEIGHT + 2))
    from diffusion_extras.cli.common import load_image, load_pipeline, pipeline_resolution
    assert pipeline_resolution(load_pipeline(str(run))) == (HEIGHT, WIDTH)
    assert load_image(f"{images}/0.png", (HEIGHT, WIDTH)).shape == (HEIGHT, WIDTH, 3)  # references cropped alike
    run_cli(["-m", "diffusion_extras.evaluate", run, "--reference", images, "--num_samples", 4,
             "--feature_extractor", "tiny", "--num_inference_steps", 2, "--batch_size", 4,
             "--cache_dir", tmp_path / "cache", "--output", tmp_path / "m.json", "--device", "cpu"])
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["reference_images"] == 16 and metrics["fid"] > 0


@pytest.mark.xdist_group("test_nonsquare.pixel_run")
def test_a_resume_compares_both_sides(pixel_run, tmp_path):
    import shutil
    run, recipe, images, _ = pixel_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    refused = run_training(recipe, out, "--train_data_dir", images, "--resolution", f"{WIDTH}x{HEIGHT}",
                           "--max_train_steps", 3, "--resume_from_checkpoint", "latest", check=False)
    assert refused.returncode != 0
    assert "resolution: [8, 16] -> [16, 8]" in refused.stderr, refused.stderr[-2000:]
    resumed = run_training(recipe, out, "--train_data_dir", images, "--resolution", f"{HEIGHT}x{WIDTH}",
                           "--max_train_steps", 3, "--resume_from_checkpoint", "latest")
    assert "done: 3 optimizer steps" in resumed.stdout


@pytest.mark.xdist_group("test_nonsquare.pixel_run")
def test_fine_tuning_a_non_square_export_trains_at_its_size(pixel_run, tmp_path):
    from diffusion_extras.training import pretrained
    from diffusion_extras.training.config import ConfigError, parse_config
    run = pixel_run[0]
    recipe = tmp_path / "no-resolution.yaml"  # the tiny recipe, --resolution left to the base
    recipe.write_text(yaml.safe_dump({k: v for k, v in TINY_RECIPE.items() if k != "resolution"}))
    flags = ["--config", str(recipe), "--pretrained_model_name_or_path", str(run), "--output_dir", str(tmp_path / "t")]
    config, base = pretrained.resolve(parse_config(flags))
    assert config.resolution == (HEIGHT, WIDTH)
    with pytest.raises(ConfigError, match=r"its UNet samples at 8x16 px and --resolution is 16x8: train at "
                                          r"--resolution 8x16 \(or leave --resolution out\)"):
        base.choice(parse_config([*flags, "--resolution", "16,8"]), 1, None)
    tuned = run_training(recipe, tmp_path / "tuned", "--pretrained_model_name_or_path", run,  # on digits
                         "--max_train_steps", 1)
    assert "at 8x16 px" in tuned.stdout
    assert json.loads((tmp_path / "tuned" / "unet" / "config.json").read_text())["sample_size"] == [HEIGHT, WIDTH]


def test_the_class_conditional_pipeline_samples_height_by_width(tmp_path):
    import torch
    from diffusers import DDPMScheduler

    from diffusion_extras.evaluation.pipeline_class_conditional import ClassConditionalPipeline
    from diffusion_extras.training import models
    unet = tiny_unet(sample_size=[HEIGHT, WIDTH], num_class_embeds=3)
    models.save_class_conditional(unet, DDPMScheduler(num_train_timesteps=10), ["a", "b"], str(tmp_path / "pipe"))
    pipe = ClassConditionalPipeline.from_pretrained(tmp_path / "pipe")
    images = pipe(class_labels=[0, 1], num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images
    assert [image.size for image in images] == [(WIDTH, HEIGHT)] * 2


def test_a_latent_run_at_a_non_square_resolution_decodes_height_by_width(tiny_recipe, tmp_path):
    import torch
    from diffusers import DiffusionPipeline
    vae = save_tiny_vae(tmp_path / "vae")  # factor 2: 8 x 16 images, 4 x 8 latents
    result = run_training(tiny_recipe(model=LATENT_MODEL), tmp_path / "run", "--pretrained_vae_model_name_or_path", vae,
                          "--resolution", "8x16", "--max_train_steps", 2)
    assert "(4x8 from 8x16 px, factor 2)" in result.stdout
    assert json.loads((tmp_path / "run" / "unet" / "config.json").read_text())["sample_size"] == [4, 8]
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "run", trust_remote_code=True)
    generator = torch.Generator().manual_seed(0)
    latents = pipe(batch_size=2, num_inference_steps=2, generator=generator, output_type="latent").images
    assert tuple(latents.shape) == (2, 2, 4, 8)
    assert pipe(batch_size=1, num_inference_steps=2).images[0].size == (WIDTH, HEIGHT)
    refused = run_training(tiny_recipe(model=LATENT_MODEL), tmp_path / "odd", "--pretrained_vae_model_name_or_path",
                           vae, "--resolution", "8x15", check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: --resolution 8x15: its width 15 is not a multiple of the VAE's downsampling factor 2: use a "
        "multiple of 2 (e.g. 14)")
