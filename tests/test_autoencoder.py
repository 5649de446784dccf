"""Latent diffusion's VAE (training/autoencoder.py): loaded from a folder of an AutoencoderKL or a
pipeline folder's vae/, frozen; the UNet follows its latents; bad input is one line before training."""
import json
import os

import pytest
import torch
from diffusers import AutoencoderTiny, VQModel
from helpers import LATENT_MODEL, TINY_RECIPE, TINY_VAE, run_training, save_tiny_pipeline, save_tiny_vae

from diffusion_extras.evaluation.pipeline_latent import latent_normalization
from diffusion_extras.training import autoencoder, models
from diffusion_extras.training.config import ConfigError, parse_config


def latent_config(tmp_path, vae, *flags, **recipe):
    import yaml
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **recipe}))
    return parse_config(["--config", str(path), "--output_dir", str(tmp_path / "run"),
                         "--pretrained_vae_model_name_or_path", str(vae), *map(str, flags)])


def test_a_vae_folder_and_a_pipeline_folders_vae_load_frozen(tmp_path):
    folder = save_tiny_vae(tmp_path / "vae")
    pipeline = tmp_path / "pipeline"
    save_tiny_vae(pipeline / "vae", seed=1)
    save_tiny_vae(pipeline / "other", seed=2, latent_channels=3)
    for path, flags, channels, seed in [(folder, (), 2, 0), (pipeline, (), 2, 1),
                                         (pipeline, ("--vae_subfolder", "other"), 3, 2)]:
        space = autoencoder.load_latent_space(latent_config(tmp_path, path, *flags))
        assert (space.image_channels, space.channels, space.factor, space.size) == (3, channels, 2, 4)
        assert not space.vae.training and not any(p.requires_grad for p in space.vae.parameters())
        torch.manual_seed(seed)  # the weights are the saved ones
        expected = type(space.vae)(**{**TINY_VAE, "latent_channels": channels})
        assert all(torch.equal(a, b) for a, b in zip(space.vae.state_dict().values(), expected.state_dict().values()))


def test_the_unet_follows_the_latents_and_the_model_line_says_so(tmp_path):
    """The digits with no model chosen: the digits recipe's shape on 2 latent channels of 4x4."""
    vae = save_tiny_vae(tmp_path / "vae")
    config = parse_config(["--output_dir", str(tmp_path / "run"), "--resolution", "8",
                           "--pretrained_vae_model_name_or_path", vae])
    space = autoencoder.load_latent_space(config)
    choice = models.follow_data(config, 1, None, space)
    unet = models.build_unet(config, choice.model, space)
    assert (unet.config.in_channels, unet.config.out_channels, unet.config.sample_size) == (2, 2, 4)
    lines = models.describe(unet, choice.description, 1, latent=space, resolution=8)
    assert lines[0].startswith("model: the digits recipe's UNet shape at 4 px")
    assert f"2 channel(s) (latents of the VAE {vae} (4x4 from 8 px, factor 2))" in lines[0]
    assert lines[1] == "data: the images are grayscale and the VAE reads 3 channel(s): converting them to RGB"


def test_a_unet_of_other_channels_is_refused(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    config = latent_config(tmp_path, vae)  # the tiny recipe's UNet: 1 channel
    space = autoencoder.load_latent_space(config)
    with pytest.raises(ConfigError, match="^the UNet has 1 -> 1 channels and the VAE's latents have 2: set "
                                          "in_channels and out_channels to 2"):
        models.build_unet(config, models.follow_data(config, 1, None, space).model, space)


def test_not_an_autoencoder_and_no_vae_are_refused(tmp_path):
    unet_folder = save_tiny_pipeline(tmp_path / "ddpm")  # a DDPMPipeline: no vae/
    with pytest.raises(ConfigError, match=r"its config is a UNet2DModel, not an autoencoder \(AutoencoderKL, VQModel, "
                                          r"AutoencoderTiny\)"):
        autoencoder.load_latent_space(latent_config(tmp_path, os.path.join(unet_folder, "unet")))
    with pytest.raises(ConfigError, match="no VAE config found"):
        autoencoder.load_latent_space(latent_config(tmp_path, unet_folder))
    with pytest.raises(ConfigError, match="missing does not exist .*; give an AutoencoderKL folder"):
        latent_config(tmp_path, tmp_path / "missing")


def test_a_vae_that_does_not_read_images_is_refused(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae", in_channels=2, out_channels=2)
    with pytest.raises(ConfigError, match="its images have 2 -> 2 channels"):
        autoencoder.load_latent_space(latent_config(tmp_path, vae))


def test_a_resolution_the_vae_cannot_encode_is_one_line_before_training(tmp_path, tiny_recipe):
    vae = save_tiny_vae(tmp_path / "vae", block_out_channels=[8, 8, 8], down_block_types=["DownEncoderBlock2D"] * 3,
                        up_block_types=["UpDecoderBlock2D"] * 3)  # factor 4
    result = run_training(tiny_recipe(resolution=10, model=LATENT_MODEL), tmp_path / "run",
                          "--pretrained_vae_model_name_or_path", vae, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --resolution 10 is not a multiple of the VAE's downsampling factor 4: use a multiple of 4 (e.g. 8)")
    assert not os.path.exists(tmp_path / "run" / "logs")


def latent_unet_at(tmp_path, resolution: str, factor: int):
    """The UNet a digits run with no model chosen builds on a tiny VAE of downsampling `factor`."""
    blocks = [8] * (factor.bit_length())  # factor 2: 2 blocks, 4: 3 blocks
    vae = save_tiny_vae(tmp_path / f"vae{factor}", block_out_channels=blocks,
                        down_block_types=["DownEncoderBlock2D"] * len(blocks),
                        up_block_types=["UpDecoderBlock2D"] * len(blocks))
    config = parse_config(["--output_dir", str(tmp_path / "run"), "--resolution", resolution,
                           "--pretrained_vae_model_name_or_path", vae])
    space = autoencoder.load_latent_space(config)
    return models.build_unet(config, models.follow_data(config, 1, None, space).model, space)


def test_latents_the_unet_cannot_halve_are_refused_naming_the_pixel_resolution(tmp_path):
    """16x24 px through the digits UNet (3 blocks): a factor-2 VAE's 8x12 latents halve twice, a
    factor-4 VAE's 4x6 do not; the message names the --resolution given and the pixel multiple."""
    assert latent_unet_at(tmp_path, "16,24", 2).config.sample_size == [8, 12]
    with pytest.raises(ConfigError) as refused:
        latent_unet_at(tmp_path, "16,24", 4)
    assert str(refused.value) == ("--resolution 16x24: its width 24 cannot be halved 2 times by the UNet's 3 "
                                  "blocks after the VAE's factor 4; use a multiple of 16 (e.g. 16)")


def test_what_latent_runs_do_not_combine_with_is_refused(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    with pytest.raises(ConfigError, match="does not combine with --no-center_crop"):
        latent_config(tmp_path, vae, "--no-center_crop")
    with pytest.raises(ConfigError, match="--vae_subfolder names a folder of --pretrained_vae_model_name_or_path"):
        parse_config(["--vae_subfolder", "vae"])


def test_a_hub_id_vae_trains_and_exports_and_offline_is_one_line_naming_why(tiny_recipe, tmp_path, monkeypatch):
    """A tiny AutoencoderKL served as the Hub repo user/tiny-vae by the loopback Hub: the run
    downloads it, trains and exports its weights in vae/, which decode. Offline and not in the Hub
    cache, the error is one line naming HF_HUB_OFFLINE (hub.download.offline_reason, whose other
    case, the Hub unreachable, costs huggingface_hub's retries: ~25 s)."""
    from diffusers import AutoencoderKL
    from hub_server import HubServer, serve_in_process
    from huggingface_hub import constants

    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline
    recipe = tiny_recipe(model=LATENT_MODEL)
    flags = ("--pretrained_vae_model_name_or_path", "user/tiny-vae", "--max_train_steps", 2)
    with HubServer() as server:
        server.add_repo("user/tiny-vae", save_tiny_vae(tmp_path / "vae"))
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        result = run_training(recipe, tmp_path / "run", *flags)
    assert "(latents of the VAE user/tiny-vae (4x4 from 8 px, factor 2))" in result.stdout
    saved, exported = (AutoencoderKL.from_pretrained(folder).state_dict() for folder in (tmp_path / "vae",
                                                                                          tmp_path / "run" / "vae"))
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)
    images = LatentDiffusionPipeline.from_pretrained(tmp_path / "run")(batch_size=1, num_inference_steps=2).images
    assert images[0].size == (8, 8) and images[0].mode == "RGB"
    # offline, a repo never downloaded (diffusers keeps its own reading of the Hub cache's folder, from import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = run_training(recipe, tmp_path / "offline", "--pretrained_vae_model_name_or_path", "user/other-vae",
                          check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: --pretrained_vae_model_name_or_path user/other-vae: cannot download it: HF_HUB_OFFLINE is set and "
        "user/other-vae is not in the Hub cache")


def scale_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("latents: their std")]


def test_a_scale_set_for_another_vae_is_named_with_the_measured_std_and_the_remedy_works(tiny_recipe,
                                                                                         tmp_path):
    """save_pretrained wrote diffusers' default scaling_factor 0.18215 into the tiny VAE's config:
    its normalised latents' std is far from 1, and one line says so with the value. Following the
    line (the scale fields removed), the run measures the statistics and says nothing; a VAE whose
    scale fits its latents says nothing either."""
    folder = save_tiny_vae(tmp_path / "vae")
    recipe = tiny_recipe(model=LATENT_MODEL)
    flags = ("--pretrained_vae_model_name_or_path", folder, "--max_train_steps", 1)
    lines = scale_lines(run_training(recipe, tmp_path / "default", *flags).stdout)
    assert len(lines) == 1 and lines[0].startswith("latents: their std normalised by the VAE config's scaling_factor "
                                                   "0.18215 is ")
    assert lines[0].endswith("remove scaling_factor, shift_factor, latents_mean and latents_std from the config.json "
                             f"of the VAE {folder}")
    std = float(lines[0].split(" is ")[1].split(",")[0])
    assert std < 1 / autoencoder.SCALE_TOLERANCE
    path = tmp_path / "vae" / "config.json"
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in stored.items()
                                if k not in ("scaling_factor", "shift_factor", "latents_mean", "latents_std")}))
    result = run_training(recipe, tmp_path / "measured", *flags)
    assert "latents: normalised by their per-channel mean and std, measured" in result.stdout
    assert not scale_lines(result.stdout)
    path.write_text(json.dumps({**stored, "scaling_factor": 0.18215 / std}))
    assert not scale_lines(run_training(recipe, tmp_path / "fitting", *flags).stdout)


def test_cached_latents_leave_the_encoder_off_the_accelerator(tmp_path, fresh_accelerate, monkeypatch):
    """Once the latents are cached the encoder is not needed on the accelerator: setup moves its
    parts (not the decoder's) to the CPU, after the cache exists (on a GPU: tests/test_cuda.py)."""
    from helpers import tiny_run
    moved = []
    monkeypatch.setattr(autoencoder, "offload_encoder", lambda vae: moved.append(vae))
    run = tiny_run(tmp_path, "--pretrained_vae_model_name_or_path", save_tiny_vae(tmp_path / "vae"), model=LATENT_MODEL)
    assert moved == [run.data.vae] and run.data.posterior.encoder is None
    assert autoencoder.ENCODER_PARTS == ("encoder", "quant_conv")
    for model in (run.data.vae, AutoencoderTiny(**TINY_AUTOENCODER_TINY), VQModel(**TINY_VQ)):  # what encodes only
        encoding = {name for name in autoencoder.ENCODER_PARTS if hasattr(model, name)}
        decoding = {name for name, _ in model.named_children()} - encoding
        assert "encoder" in encoding and "decoder" in decoding and not any("enc" in name for name in decoding)


# AutoencoderTiny and VQModel of two blocks (factor 2), 2 latent channels, as TINY_VAE
TINY_AUTOENCODER_TINY = dict(in_channels=3, out_channels=3, encoder_block_out_channels=[8, 8],
                             decoder_block_out_channels=[8, 8], num_encoder_blocks=[1, 1], num_decoder_blocks=[1, 1],
                             latent_channels=2)
TINY_VQ = dict(TINY_VAE, num_vq_embeddings=16)


@pytest.mark.parametrize("kind", ["AutoencoderTiny", "VQModel"])
def test_deterministic_autoencoders_train_export_and_decode_as_diffusers_pipelines_do(kind, tiny_recipe,
                                                                                      tmp_path):
    """An AutoencoderTiny and a VQModel (LDMPipeline's) encode one latent per image (std 0), train
    and export a latent pipeline whose vae/ is of their class and decodes as diffusers does: a
    VQModel quantises its latents, AutoencoderTiny's decoder takes them as they are."""
    import diffusers

    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline, encode_posterior
    torch.manual_seed(0)
    model = getattr(diffusers, kind)(**(TINY_AUTOENCODER_TINY if kind == "AutoencoderTiny" else TINY_VQ))
    model.save_pretrained(tmp_path / "vae")
    pixels = torch.rand(2, 3, 8, 8) * 2 - 1
    mean, std = encode_posterior(model.eval(), pixels)
    assert mean.shape == (2, 2, 4, 4) and std.abs().max() == 0
    run_training(tiny_recipe(model=LATENT_MODEL), tmp_path / "run", "--pretrained_vae_model_name_or_path",
                 tmp_path / "vae", "--max_train_steps", 2)
    assert json.loads((tmp_path / "run" / "model_index.json").read_text())["vae"] == ["diffusers", kind]
    pipe = LatentDiffusionPipeline.from_pretrained(tmp_path / "run")
    assert type(pipe.vae).__name__ == kind and pipe.vae_scale_factor == 2
    out = pipe(batch_size=2, num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0))
    images = pipe(batch_size=2, num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0))
    shift, scale = (v.view(1, -1, 1, 1) for v in latent_normalization(pipe.vae.config, 2))
    with torch.no_grad():
        expected = pipe.vae.decode(out.images / scale + shift).sample  # diffusers' own decode of the latents
    torch.testing.assert_close(images.images, (expected / 2 + 0.5).clamp(0, 1))
