"""Each artifact is callable on its own: a UNet, an EMA, a scheduler and a Target, no run."""
import json

import numpy as np
import torch
from diffusers import DDPMPipeline, DDPMScheduler
from helpers import tiny_unet
from PIL import Image

from diffusion_extras.core.ema import ExponentialMovingAverage
from diffusion_extras.evaluation import sampling
from diffusion_extras.training import artifacts, tracking


def tiny_unet_and_ema():
    unet = tiny_unet()
    ema = ExponentialMovingAverage(unet.parameters())
    with torch.no_grad():  # the EMA holds other weights than the raw UNet
        for shadow in ema.shadow_params:
            shadow.add_(0.05)
    return unet, ema


def test_sampling_unet_is_an_fp32_copy_holding_the_ema_weights():
    unet, ema = tiny_unet_and_ema()
    unet = unet.to(torch.bfloat16)
    raw = [p.detach().clone() for p in unet.parameters()]
    with artifacts.sampling_unet(unet, ema) as copy:
        assert copy is not unet and {p.dtype for p in copy.parameters()} == {torch.float32}
        for got, shadow in zip(copy.parameters(), ema.shadow_params):
            assert torch.equal(got, shadow.float())
    with artifacts.sampling_unet(unet) as copy:  # no EMA: the raw weights, in fp32
        assert all(torch.equal(got, p.float()) for got, p in zip(copy.parameters(), raw))
    assert all(torch.equal(p, r) for p, r in zip(unet.parameters(), raw)), "the training weights changed"


def test_sample_grid_and_export_without_a_run(tmp_path):
    unet, ema = tiny_unet_and_ema()
    scheduler = DDPMScheduler(num_train_timesteps=100)
    history = tracking.History(str(tmp_path))
    target = artifacts.Target(str(tmp_path), step=7, history=history)
    path = artifacts.save_sample_grid(unet, ema, scheduler, target, num_images=4, num_inference_steps=2, seed=3)
    assert path == str(tmp_path / "samples" / "step_000007.png")
    with artifacts.sampling_unet(unet, ema) as copy:  # the grid is the EMA weights' DDIM samples
        expected = sampling.image_grid(sampling.generate(copy, sampling.make_scheduler("ddim", scheduler.config),
                                                         4, 2, seed=3, device="cpu"))
    np.testing.assert_array_equal(np.asarray(Image.open(path)), np.asarray(expected))
    assert (tmp_path / artifacts.CARD_GRID).read_bytes() == (tmp_path / "samples" / "step_000007.png").read_bytes()

    artifacts.export(unet, ema, scheduler, target)
    pipeline = DDPMPipeline.from_pretrained(str(tmp_path))
    for got, shadow in zip(pipeline.unet.parameters(), ema.shadow_params):
        assert torch.equal(got, shadow)
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())["num_train_timesteps"] == 100

    target.log_values({"eval/fid": 1.5})  # no accelerator: history only
    assert history.read() == [{"step": 7, "eval/fid": 1.5}]
