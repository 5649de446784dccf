"""Grids, FID and the exported pipeline sample the EMA weights in fp32 whatever --mixed_precision
says, while training keeps its autocast (bf16 on CPU here); for both objectives and the DiT."""
import numpy as np
import pytest
import torch
from helpers import load_unet_weights, tiny_dit_recipe, tiny_run
from PIL import Image

from diffusion_extras.evaluation import sampling
from diffusion_extras.training import artifacts, backbones, loop


def fp32_grid(run, unet, dtype=torch.float32) -> np.ndarray:
    config = run.config
    scheduler = sampling.training_sampler(run.objective.noise_scheduler.config)  # DDIM, or Euler for flow
    images = sampling.generate(unet, scheduler, config.eval_batch_size, config.ddpm_num_inference_steps,
                               seed=config.seed, device="cpu", dtype=dtype)
    return np.asarray(sampling.image_grid(images))


@pytest.mark.parametrize("objective, model_type", [("ddpm", "unet"), ("flow_matching", "unet"), ("ddpm", "dit")])
def test_bf16_run_samples_its_grid_in_fp32(tmp_path, fresh_accelerate, objective, model_type):
    steps = 4
    run = tiny_run(tmp_path, "--mixed_precision", "bf16", "--use_ema", "--max_train_steps", steps,
                   "--objective", objective, ddpm_num_inference_steps=10, save_images_steps=1000,
                   **(tiny_dit_recipe(tmp_path) if model_type == "dit" else {}))
    loop.train(run)
    saved = np.asarray(Image.open(tmp_path / "run" / "samples" / f"step_{steps:06d}.png"))

    # the same EMA weights, sampled separately in plain fp32
    ema_unet = backbones.for_config(run.config).build(run.config, run.plan.model)
    run.extras.ema.copy_to(ema_unet.parameters())
    np.testing.assert_array_equal(saved, fp32_grid(run, ema_unet))
    # the comparison can tell: the same weights under bf16 autocast give another grid
    assert not np.array_equal(saved, fp32_grid(run, ema_unet, torch.bfloat16))

    weights = load_unet_weights(tmp_path / "run")  # the exported pipeline: the EMA weights, fp32
    assert {w.dtype for w in weights.values()} == {torch.float32}
    for (name, _), shadow in zip(ema_unet.named_parameters(), run.extras.ema.shadow_params):
        assert torch.equal(weights[name], shadow), f"exported {name} is not the EMA weight"


def test_training_forward_keeps_its_autocast_after_sampling(tmp_path, fresh_accelerate):
    run = tiny_run(tmp_path, "--mixed_precision", "bf16", "--max_train_steps", 1)
    inner = run.accelerator.unwrap_model(run.learner.unet)
    seen = []
    inner.conv_in.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    noisy, timesteps = torch.randn(2, 1, 8, 8), torch.tensor([10, 500])
    with artifacts.sampling_unet(inner) as unet:
        unet(noisy, timesteps)  # a copy: the hook on the training UNet does not fire
    assert seen == []
    run.learner.unet(noisy, timesteps)
    assert seen == [torch.bfloat16], "the training forward lost accelerate's bf16 autocast"
