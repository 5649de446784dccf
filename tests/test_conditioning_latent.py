"""Conditioning on images in latent space: the images are encoded in the step, the condition by
the same VAE (its mean, normalised as the latents; an inpainting mask pooled to their size), and
the exported pipeline (with vae/) decodes, keeps the unmasked pixels and loads without the package."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    LATENT_MODEL,
    paired_images,
    read_history,
    run_training,
    save_tiny_vae,
    write_paired_parquet,
    write_tiny_recipe,
)
from package_blocker import run_without_the_package
from PIL import Image

from diffusion_extras.data import latents
from diffusion_extras.evaluation.pipeline_image_conditioned import (
    ImageConditionedPipeline,
    degrade,
    encode_normalised,
    upsample,
)
from diffusion_extras.training.conditioning import ImageCondition

# Without the package: the super-resolution export doubles a 4x4 RGB image (decoded pixels, or its
# latents), the inpainting export fills an 8x8 RGB image's left half and gives the right half back,
# the image-to-image export maps a grey 8x8 condition to an RGB image; each with DPM-Solver.
BLOCKED_LOAD = """
import sys
import numpy as np, torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler
from PIL import Image
rng = np.random.default_rng(0)
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
low = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
images = pipe(image=low, num_inference_steps=3, output_type="np").images
latents = pipe(image=low, num_inference_steps=3, output_type="latent").images
assert images.shape == (1, 8, 8, 3) and tuple(latents.shape) == (1, 2, 4, 4), (images.shape, latents.shape)
pipe = DiffusionPipeline.from_pretrained(sys.argv[2], trust_remote_code=True)
photo = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
mask = np.zeros((8, 8), np.uint8)
mask[:, :4] = 255
filled = pipe(image=Image.fromarray(photo), mask_image=Image.fromarray(mask), num_inference_steps=3).images[0]
filled = np.asarray(filled)
assert np.array_equal(filled[:, 4:], photo[:, 4:]) and not np.array_equal(filled[:, :4], photo[:, :4])
pipe = DiffusionPipeline.from_pretrained(sys.argv[3], trust_remote_code=True)
pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
condition = Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8))  # a grey PIL image, made RGB
mapped = pipe(image=condition, num_inference_steps=3, output_type="np").images
assert mapped.shape == (1, 8, 8, 3) and np.isfinite(mapped).all(), mapped.shape
print(type(pipe).__name__, pipe.config.conditioning, type(pipe.vae).__name__, "ok")
"""


@pytest.fixture(scope="module")
def latent_runs(tmp_path_factory):
    """2-step latent runs with the tiny RGB VAE: 2x super-resolution and inpainting with random
    masks on the digits (tiny recipe, a held-out tenth, the gradient probe, grids of 4 conditions),
    and image-to-image on a column of pairs."""
    folder = tmp_path_factory.mktemp("latent_conditioning")
    vae = save_tiny_vae(folder / "vae")
    recipe = write_tiny_recipe(folder, model=LATENT_MODEL, save_images_steps=2, eval_batch_size=4,
                               validation_split=0.1, validation_steps=2, grad_diagnostics_steps=2)
    runs = {}
    for kind in ("super_resolution", "inpainting"):
        runs[kind] = folder / kind
        run_training(recipe, runs[kind], "--pretrained_vae_model_name_or_path", vae, "--conditioning", kind,
                     *(("--sr_factor", 2) if kind == "super_resolution" else ()), "--max_train_steps", 2)
    images, pairs = paired_images(16, 8, 8, seed=4)
    data = write_paired_parquet(folder / "pairs.parquet", images, pairs, "edges")
    runs["image"] = folder / "image"
    run_training(write_tiny_recipe(folder, model=LATENT_MODEL, max_train_samples=None), runs["image"],
                 "--train_data_files", data, "--conditioning", "image", "--conditioning_image_column", "edges",
                 "--pretrained_vae_model_name_or_path", vae, "--max_train_steps", 2)
    return runs


LATENT_RUNS = pytest.mark.xdist_group("test_conditioning_latent.latent_runs")


@LATENT_RUNS
def test_the_exports_hold_the_vae_and_a_unet_that_takes_the_latent_condition(latent_runs):
    for kind, added in (("super_resolution", 2), ("inpainting", 3)):  # the latents' 2 channels (and the mask)
        run = latent_runs[kind]
        index = json.loads((run / "model_index.json").read_text())
        assert (index["conditioning"], index["vae"]) == (kind, ["diffusers", "AutoencoderKL"])
        assert json.loads((run / "unet" / "config.json").read_text())["in_channels"] == 2 + added
        with Image.open(run / "samples" / "step_000002.png") as grid:  # decoded 8 px triplets
            assert grid.size == (2 + 6 * 10, 2 + 2 * 10) and grid.mode == "RGB"
        history = {key: value for row in read_history(run) for key, value in row.items()}
        assert np.isfinite(history["validation/raw_loss"]) and np.isfinite(history["grad_probe/total_norm"])


@LATENT_RUNS
def test_the_exports_load_without_the_package_decode_and_keep_the_unmasked_pixels(latent_runs, tmp_path):
    result = run_without_the_package(BLOCKED_LOAD, tmp_path, latent_runs["super_resolution"],
                                     latent_runs["inpainting"], latent_runs["image"])
    assert "ImageConditionedPipeline image AutoencoderKL ok" in result.stdout


def test_the_condition_is_encoded_by_the_vae_and_the_mask_pooled_to_the_latents(tmp_path):
    """The step's inputs of an RGB batch: the clean input is the image's latent drawn from its
    posterior (what a streamed latent run draws), the condition the VAE's normalised mean of the
    pixel condition, after the mask max-pooled to the latents' 4 x 4 (a latent to be filled where
    any of its pixels is)."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(save_tiny_vae(tmp_path / "vae")).eval()
    posterior = latents.Posterior(2, 1, torch.tensor([0.1, -0.2]), torch.tensor([0.5, 2.0]),
                                  latents.Encoder.of(vae, False, factor=2))
    vae.register_to_config(latents_mean=[0.1, -0.2], latents_std=[2.0, 0.5], scaling_factor=1.0)  # the same
    batch = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 3, 8, 8), dtype=np.uint8))
    pixels = batch.float() / 127.5 - 1
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    for kind in ("super_resolution", "inpainting"):
        condition = ImageCondition(kind, 3, 0, 2, seed=0, vae=vae)
        seeds = condition.mask_seeds(5, 0, 3)
        clean, given = condition.inputs(batch, "cpu", seeds, posterior=posterior, noise=noise)
        torch.testing.assert_close(clean, posterior.model_input(batch, "cpu", noise=noise))
        _, pixel_condition = condition.split(pixels, seeds)
        if kind == "super_resolution":
            torch.testing.assert_close(given, encode_normalised(vae, upsample(degrade(pixels, 2), 2)))
        else:
            mask = pixel_condition[:, :1]
            assert 0 < mask.mean() < 1
            assert torch.equal(given[:, :1], F.max_pool2d(mask, 2))
            torch.testing.assert_close(given[:, 1:], encode_normalised(vae, pixels * (1 - mask)))
        mean = vae.encode(pixels).latent_dist.mean.detach()  # the normalisation: the posterior's
        torch.testing.assert_close(encode_normalised(vae, pixels), posterior.draw(mean, None, "cpu"))


@LATENT_RUNS
def test_image_pairs_train_in_latent_space(latent_runs):
    """Image-to-image on a column of pairs with the tiny VAE: the pair is encoded as the condition
    (the latents' 2 channels after x_t's), and the package's class loads the export."""
    pipe = ImageConditionedPipeline.from_pretrained(latent_runs["image"])
    assert pipe.unet.config.in_channels == 4 and pipe.vae is not None and pipe.config.conditioning == "image"
    condition = Image.fromarray(np.full((8, 8), 200, np.uint8))
    images = pipe(image=condition, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 8, 8, 3) and np.isfinite(images).all()
