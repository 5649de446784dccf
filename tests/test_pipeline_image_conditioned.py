"""The image-conditioned pipeline (evaluation/pipeline_image_conditioned.py): the condition it
gives the UNet is the one training gives it, from PIL, numpy or tensors; any compatible scheduler
starts from its own noise level; inpainting keeps the pixels outside the mask; guidance on the
image; the refusals."""
import re

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from helpers import tiny_unet
from PIL import Image

from diffusion_extras.evaluation.pipeline_class_conditional import guided_model_output
from diffusion_extras.evaluation.pipeline_image_conditioned import (
    ImageConditionedPipeline,
    back_project,
    condition_channels,
    degrade,
    sample_channels,
    shrink,
    upsample,
)
from diffusion_extras.evaluation.pipeline_images import image_batch
from diffusion_extras.training.conditioning import ImageCondition


def pipeline(kind: str, channels: int = 1, sr_factor: int = 2, seed: int = 0) -> ImageConditionedPipeline:
    """A tiny pixel pipeline of `kind` (random weights) with the trainer's noise scheduler (its
    settings written out, as exports hold them), its progress bar off."""
    from diffusion_extras.training.config import TrainConfig
    from diffusion_extras.training.models import build_noise_scheduler

    unet = tiny_unet(channels, seed=seed, in_channels=channels + condition_channels(kind, channels))
    pipe = ImageConditionedPipeline(unet, build_noise_scheduler(TrainConfig(ddpm_num_steps=100)), conditioning=kind,
                                    sr_factor=sr_factor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def unet_inputs(pipe) -> list:
    """The UNet's input of each call, recorded (a forward pre-hook)."""
    inputs = []
    pipe.unet.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
    return inputs


def random_uint8(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_a_low_resolution_png_gives_the_unet_the_condition_training_gives_it(tmp_path):
    """Training degrades an image (antialiased bicubic, rounded to 8 bits) and upsamples it back; a
    user's 8-bit low-resolution file of that image, read as PIL, numpy or a tensor, makes the same
    condition in the pipeline, after the noise x_t in the UNet's input."""
    image = random_uint8((2, 8, 12, 1))
    pixels = torch.from_numpy(image).permute(0, 3, 1, 2).float() / 127.5 - 1
    condition = ImageCondition("super_resolution", 1, 0, 2, seed=0)
    _, trained = condition.split(pixels, [])
    low = np.round((degrade(pixels, 2).permute(0, 2, 3, 1).numpy() + 1) * 127.5).astype(np.uint8)
    Image.fromarray(low[0, :, :, 0]).save(tmp_path / "low.png")
    pipe = pipeline("super_resolution")
    inputs = unet_inputs(pipe)
    with Image.open(tmp_path / "low.png") as png:
        pipe(image=png, num_inference_steps=1)
    pipe(image=low, num_inference_steps=1)  # uint8 numpy, a batch
    pipe(image=torch.from_numpy(low).permute(0, 3, 1, 2).float() / 255, num_inference_steps=1)
    for given, seen in zip([trained[:1], trained, trained], inputs):
        assert seen.shape == (len(given), 2, 8, 12)
        torch.testing.assert_close(seen[:, 1:], given, atol=1e-6, rtol=0)
    torch.testing.assert_close(trained, upsample(degrade(pixels, 2), 2))


@pytest.mark.parametrize("name", sorted(cls.__name__ for cls in DDPMScheduler().compatibles  # a set's order varies
                                         if cls.__name__ != "DPMSolverSDEScheduler"))  # that one needs torchsde
def test_every_compatible_scheduler_starts_from_its_own_noise_level(name):
    """A fresh pipeline's first call equals its second with the same seed: the initial noise is
    scaled by the init_noise_sigma of the schedule set for the call (set_timesteps first, as
    diffusers does), not by the one the scheduler had before."""
    import diffusers

    pipe = pipeline("super_resolution")
    pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config)
    low = random_uint8((4, 6))
    calls = [[], []]
    for steps in calls:  # x_t after each step (the images saturate: a random UNet)
        pipe(image=low, num_inference_steps=4, generator=torch.Generator().manual_seed(0), output_type="np",
             callback_on_step_end=lambda pipe, step, t, values, steps=steps: steps.append(values["latents"].clone())
             or {})
    first, second = calls
    assert len(first) == len(pipe.scheduler.timesteps) and torch.isfinite(first[-1]).all()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_one_trailing_ddim_step_returns_the_models_estimate_of_x0_from_pure_noise(prediction_type):
    """The commands' --scheduler ddim --timestep_spacing trailing --num_inference_steps 1: one UNet
    call, at the schedule's last timestep, and the image is the x_0 that call predicts (clipped to
    [-1, 1]): the model's estimate of the posterior mean given the condition. With the default
    leading spacing the one step is timestep 0 instead, where x_t is taken for a nearly clean image."""
    from diffusion_extras.evaluation.sampling import make_scheduler

    pipe = pipeline("super_resolution")
    trained = DDPMScheduler.from_config(pipe.scheduler.config, prediction_type=prediction_type)
    calls = []
    pipe.unet.register_forward_hook(lambda module, args, kwargs, out: calls.append(
        (args[0].clone(), int(args[1] if len(args) > 1 else kwargs["timestep"]), out.sample.clone())), with_kwargs=True)
    low, noise = random_uint8((2, 4, 4, 1)), torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    pipe.scheduler = make_scheduler("ddim", trained.config, "trailing")
    images = pipe(image=low, num_inference_steps=1, latents=noise, output_type="pt").images
    [(x_t, t, output)] = calls
    assert t == 99 and torch.equal(x_t[:, :1], noise)
    alpha_bar = trained.alphas_cumprod[t]
    if prediction_type == "epsilon":
        x0 = (noise - (1 - alpha_bar).sqrt() * output) / alpha_bar.sqrt()
    else:
        x0 = alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * output
    assert torch.allclose(images, (x0.clamp(-1, 1) + 1) / 2, atol=1e-6)
    assert 0.05 < images.std() and not torch.allclose(images, images.mean())  # not a saturated constant
    calls.clear()
    pipe.scheduler = make_scheduler("ddim", trained.config)
    pipe(image=low, num_inference_steps=1, latents=noise, output_type="pt")
    assert calls[0][1] == 0


def test_back_projection_makes_an_upscaled_image_give_its_low_resolution_input_back():
    """back_project: an upscaled image with detail that its input does not hold, shrunk as training
    degrades images (before the 8-bit rounding), misses its input; 10 steps of back-projection
    bring it within a quarter of an 8-bit level, 30 within a thousandth of one. The pipeline's
    back_projection_steps is back_project of its plain output (the same noise); an inpainting
    pipeline refuses it."""
    smooth = torch.nn.functional.avg_pool2d(torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                                            5, 1, 2) * 1.2 - 0.6
    for factor in (2, 4):
        low = shrink(smooth, factor)
        detail = upsample(low, factor) + 0.2 * (torch.arange(32) % 2 * 2 - 1).float()  # a stripe at full resolution
        misses = [(shrink(back_project(detail, low, factor, steps), factor) - low).abs().max() for steps in (0, 10, 30)]
        assert misses[0] > 0.03 and misses[1] < 0.25 / 127.5 and misses[2] < 0.001 / 127.5, (factor, misses)

    pipe = pipeline("super_resolution", channels=3)
    low = random_uint8((2, 6, 6, 3), seed=5)
    given = torch.from_numpy(low).permute(0, 3, 1, 2).float() / 127.5 - 1

    def upscale(steps):
        generators = [torch.Generator().manual_seed(i) for i in range(2)]
        return pipe(image=low, num_inference_steps=3, generator=generators, output_type="pt",
                    back_projection_steps=steps).images * 2 - 1

    plain, projected = upscale(0), upscale(10)
    assert torch.allclose(projected, back_project(plain, given, 2, 10), atol=1e-5)
    assert (projected - plain).abs().max() > 0.1
    with pytest.raises(ValueError, match="super-resolution only"):
        pipeline("inpainting")(image=random_uint8((1, 8, 8, 1)), mask_image=np.ones((8, 8)), back_projection_steps=1)


def test_inpainting_fills_the_mask_and_gives_the_other_pixels_back():
    """Mask white = to fill; an RGB photo: every pixel outside the mask comes back as given (8-bit,
    PIL output), the UNet sees the mask and the image with the masked pixels at 0 (grey)."""
    photo = random_uint8((8, 16, 3), seed=1)
    mask = np.zeros((8, 16), np.uint8)
    mask[2:6, 3:11] = 255
    pipe = pipeline("inpainting", channels=3)
    inputs = unet_inputs(pipe)
    out = pipe(image=Image.fromarray(photo), mask_image=Image.fromarray(mask), num_inference_steps=2,
               generator=torch.Generator().manual_seed(0)).images[0]
    result = np.asarray(out)
    assert out.size == (16, 8) and out.mode == "RGB"
    assert np.array_equal(result[mask == 0], photo[mask == 0])
    assert not np.array_equal(result[mask > 0], photo[mask > 0])
    seen = inputs[0][0]
    assert seen.shape == (7, 8, 16)  # x_t (3), the mask (1), the masked image (3)
    assert torch.equal(seen[3], torch.from_numpy(mask > 0).float())
    torch.testing.assert_close(seen[4:], torch.from_numpy(np.where(mask[..., None] > 0, 0.0, photo / 127.5 - 1))
                               .permute(2, 0, 1).float(), atol=1e-6, rtol=0)


def test_each_image_of_a_batch_is_its_own_call_with_a_list_of_generators():
    """Image-to-image, non-square, float numpy input: a batch with a generator per image gives the
    images of one call per image."""
    pipe = pipeline("image")
    images = random_uint8((3, 8, 16, 1)).astype(np.float32) / 255
    batch = pipe(image=images, num_inference_steps=3, output_type="np",
                 generator=[torch.Generator().manual_seed(seed) for seed in range(3)]).images
    alone = [pipe(image=images[i:i + 1], num_inference_steps=3, output_type="np",
                  generator=torch.Generator().manual_seed(i)).images[0] for i in range(3)]
    assert batch.shape == (3, 8, 16, 1)
    np.testing.assert_allclose(batch, np.stack(alone), atol=1e-5)
    tensors = pipe(image=torch.from_numpy(images).permute(0, 3, 1, 2), num_inference_steps=3, output_type="pt",
                   generator=[torch.Generator().manual_seed(seed) for seed in range(3)]).images
    np.testing.assert_allclose(tensors.permute(0, 2, 3, 1).numpy(), batch, atol=1e-6)


def test_guidance_on_the_image_weighs_the_prediction_without_the_condition():
    """guidance_scale s: weak + s (strong - weak), weak the prediction with the condition dropped
    (zeros, as training drops it), from one batched call."""
    unet = tiny_unet(1, in_channels=2).eval()
    sample, condition = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    t = torch.tensor(10)
    with torch.no_grad():
        strong = unet(torch.cat([sample, condition], 1), t).sample
        weak = unet(torch.cat([sample, torch.zeros_like(condition)], 1), t).sample
        guided = guided_model_output(unet, sample, t, None, 3.0, condition=condition)
        plain = guided_model_output(unet, sample, t, None, 1.0, condition=condition)
    torch.testing.assert_close(guided, weak + 3 * (strong - weak), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, strong)


def test_what_the_pipeline_refuses():
    pipe = pipeline("super_resolution")
    with pytest.raises(ValueError, match=r"image of shape \(5, 4, 4\): give \[H, W\], \[C, H, W\] or \[N, C, H, W\]"):
        pipe(image=torch.zeros(5, 4, 4), num_inference_steps=1)
    with pytest.raises(ValueError, match="would be 7x8 .*UNet needs sides that are multiples of 2"):
        pipeline("image")(image=np.zeros((7, 8), np.uint8), num_inference_steps=1)
    with pytest.raises(ValueError, match="mask_image is for inpainting"):
        pipe(image=np.zeros((4, 4), np.uint8), mask_image=np.zeros((8, 8), np.uint8), num_inference_steps=1)
    with pytest.raises(ValueError, match="needs mask_image"):
        pipeline("inpainting")(image=np.zeros((8, 8), np.uint8), num_inference_steps=1)
    with pytest.raises(ValueError, match="conditioning 'colour' is not one of"):
        ImageConditionedPipeline(tiny_unet(1), DDPMScheduler(), conditioning="colour")


def mask_forms(mask: np.ndarray) -> dict:
    """One bool mask [H, W] (True = to fill) in every form users store one: 0/1 and 0/255 in 8 and
    16 bits, booleans, grayscale with soft edges, RGB, opaque RGBA, a palette, numpy and torch."""
    u8 = mask.astype(np.uint8)
    soft = np.where(mask, 200, 40).astype(np.uint8)  # soft-edged grey: above and below half
    rgb = np.stack([u8 * 255] * 3, axis=-1)
    palette = Image.fromarray(u8, "P")
    palette.putpalette([0, 0, 0, 255, 255, 255])  # index 1 shows white: read as the colours it shows
    return {
        "uint8 0/1": u8, "uint8 0/255": u8 * 255, "bool": mask, "int64 0/1": mask.astype(np.int64),
        "uint16 0/65535": u8.astype(np.uint16) * 65535, "float 0/1": mask.astype(np.float32),
        "float 8-bit levels": u8.astype(np.float32) * 255, "soft grey": soft, "numpy HWC RGB": rgb,
        "PIL 1": Image.fromarray(mask), "PIL L 0/1": Image.fromarray(u8), "PIL L 0/255": Image.fromarray(u8 * 255),
        "PIL I;16": Image.fromarray(u8.astype(np.uint16) * 65535), "PIL RGB": Image.fromarray(rgb),
        "PIL RGBA opaque": Image.fromarray(np.dstack([rgb, np.full_like(u8, 255)])), "PIL P": palette,
        "torch uint8 0/1": torch.from_numpy(u8), "torch bool": torch.from_numpy(mask),
        "torch float [1, 1, H, W]": torch.from_numpy(mask).float()[None, None],
    }


def test_a_mask_in_any_common_form_fills_the_same_pixels(tmp_path):
    """The UNet's mask channel, and the pixels that come back as given, are the same for one mask
    in each form: a 0/1 mask (how segmentation masks are saved) fills what a 0/255 one does, not
    nothing; a file read back from disk (8-bit and 16-bit PNG, palette) too."""
    mask = np.zeros((8, 12), bool)
    mask[2:6, 3:9] = True
    photo = random_uint8((8, 12, 1), seed=2)
    pipe = pipeline("inpainting")
    inputs = unet_inputs(pipe)
    forms = mask_forms(mask)
    for name in ("PIL L 0/1", "PIL I;16", "PIL P"):
        forms[name].save(tmp_path / "mask.png")
        with Image.open(tmp_path / "mask.png") as saved:
            saved.load()
            forms[f"{name}, a PNG"] = saved
    for name, form in forms.items():
        inputs.clear()
        out = pipe(image=photo, mask_image=form, num_inference_steps=1, output_type="np").images[0]
        assert torch.equal(inputs[0][0, 1], torch.from_numpy(mask).float()), name
        assert np.array_equal(np.round(out[~mask] * 255), photo[~mask].astype(np.float32)), name


def test_a_mask_of_another_size_is_resized_and_one_that_cannot_be_read_as_meant_is_refused():
    """A mask twice its image's size is resized as diffusers' mask processor resizes (nearest) and
    fills the same pixels; another aspect ratio, a label map, a colour mask, a transparent one and
    a count of masks that is neither 1 nor the images' are refused with one line, before the UNet runs."""
    mask = np.zeros((8, 12), bool)
    mask[2:6, 3:9] = True
    pipe = pipeline("inpainting")
    inputs = unet_inputs(pipe)
    photo = random_uint8((8, 12, 1), seed=2)
    pipe(image=photo, mask_image=np.kron(mask, np.ones((2, 2), bool)).astype(np.uint8), num_inference_steps=1)
    assert torch.equal(inputs[0][0, 1], torch.from_numpy(mask).float())
    inputs.clear()
    red = np.zeros((8, 12, 3), np.uint8)
    red[mask] = (255, 0, 0)
    transparent = np.dstack([np.full((8, 12, 3), 255, np.uint8), mask.astype(np.uint8) * 255])
    refused = {
        "is 12x8 .* and its image 8x12: another aspect ratio": np.ones((12, 8), np.uint8),
        "reach 3 of 255 and none reaches half, so it would fill nothing; a label map": mask * 3 + (~mask) * 1,
        "is in colour": Image.fromarray(red),
        "is transparent in places": Image.fromarray(transparent),
        "holds 3 masks for 2 images": np.zeros((3, 8, 12), np.uint8),
        "holds floats up to 2.5": mask * 2.5,
    }
    for message, form in refused.items():
        images = np.stack([photo, photo]) if "3 masks" in message else photo
        with pytest.raises(ValueError, match=message):
            pipe(image=images, mask_image=form.astype(np.uint8) if "label" in message else form,
                 num_inference_steps=1)
    assert not inputs


def test_an_exported_inpainting_pipeline_reads_masks_by_the_rule_without_the_package(tmp_path):
    """save_pretrained writes pipeline_masks.py and pipeline_images.py beside the pipeline's file; a
    process without the package loads the folder (trust_remote_code), gives the UNet a 0/1 mask as
    the mask it is and keeps the pixels it does not mark. (The filled pixels are sampled: any one of
    them may come out 100 by chance, so the UNet's mask channel is what is compared, not a count of
    changed pixels.)"""
    from package_blocker import run_without_the_package

    pipeline("inpainting").save_pretrained(tmp_path / "export")
    assert all((tmp_path / "export" / name).is_file() for name in ("pipeline_masks.py", "pipeline_images.py"))
    script = """
import sys
import numpy as np, torch
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
image = np.full((8, 8), 100, np.uint8)
mask = np.zeros((8, 8), np.uint8)
mask[:, :4] = 1
seen = []
pipe.unet.register_forward_pre_hook(lambda module, args: seen.append(args[0][0, 1].clone()))
out = pipe(image=image, mask_image=mask, num_inference_steps=2, output_type="np").images[0, :, :, 0]
print("mask channel as given:", all(torch.equal(s, torch.from_numpy(mask).float()) for s in seen), len(seen))
print("kept", int((np.round(out * 255) == 100)[mask == 0].sum()), "of", int((mask == 0).sum()))
"""
    result = run_without_the_package(script, tmp_path, tmp_path / "export")
    assert "mask channel as given: True 2" in result.stdout
    assert "kept 32 of 32" in result.stdout


def test_transparent_inputs_are_composited_on_the_runs_background(tmp_path):
    """A transparent input is composited as the trainer composited its images: on the background the
    export records (--background), white for an export that records none; in the pipeline and in
    the commands' reading of image files alike."""
    from diffusion_extras.cli.common import load_image, read_images
    from diffusion_extras.training.config import TrainConfig
    from diffusion_extras.training.models import build_noise_scheduler

    rgba = np.zeros((4, 6, 4), np.uint8)
    rgba[..., :3] = 200
    rgba[:, :3, 3] = 255  # the left half opaque grey 200, the right half transparent
    Image.fromarray(rgba).save(tmp_path / "input.png")
    unet = tiny_unet(1, in_channels=2)
    for background, behind in ((None, 255), ([0, 0, 0], 0), ([255, 0, 0], round(0.299 * 255))):
        pipe = ImageConditionedPipeline(unet, build_noise_scheduler(TrainConfig(ddpm_num_steps=100)), sr_factor=2,
                                        background=background)
        for form in (Image.fromarray(rgba), rgba, torch.from_numpy(rgba).permute(2, 0, 1)):
            read = (pipe.preprocess_image(form)[0, 0] + 1) / 2 * 255
            torch.testing.assert_close(read[:, :3], torch.full((4, 3), 200.0), atol=1e-3, rtol=0)
            torch.testing.assert_close(read[:, 3:], torch.full((4, 3), float(behind)), atol=0.6, rtol=0)
        stored = pipe.background
        for read in (read_images([str(tmp_path / "input.png")], 1, stored)[0, :, :, 0],
                     load_image(str(tmp_path / "input.png"), (4, 6), 1, stored)[:, :, 0]):
            assert (read[:, :3] == 200).all() and (np.abs(read[:, 3:].astype(int) - behind) <= 1).all(), background


def test_every_form_of_an_image_is_read_as_meant_for_the_pipelines_channels():
    """One RGBA picture given as every form users hold images in (PIL in any mode, numpy [H, W, C] /
    [N, H, W, C] / [H, W], torch [C, H, W] / [N, C, H, W] / [H, W], uint8, uint16 or float, lists of
    them), read by diffusers' layouts (numpy channels-last, torch channels-first) and converted as
    the trainer converts images: transparency on white, RGB -> L by Pillow's weights, L -> RGB by
    copies; a layout that fits neither convention is refused naming its shape."""
    rgba = random_uint8((8, 12, 4), seed=3)
    picture = Image.fromarray(rgba, "RGBA")
    on_white = Image.alpha_composite(Image.new("RGBA", picture.size, "white"), picture)
    expected = {channels: torch.from_numpy(np.asarray(on_white.convert("L" if channels == 1 else "RGB"),
                                                      np.float32) / 255).reshape(8, 12, -1).permute(2, 0, 1)[None]
                for channels in (1, 3)}
    rgb = np.asarray(on_white.convert("RGB"))
    grey = np.asarray(on_white.convert("L"))
    chw = torch.from_numpy(rgb).permute(2, 0, 1)
    forms = {"PIL RGBA": picture, "PIL RGB": on_white.convert("RGB"),
             "numpy HWC RGBA": rgba, "numpy HWC uint8": rgb, "numpy NHWC float": rgb[None] / 255.0,
             "numpy HWC uint16": rgb.astype(np.uint16) * 257, "torch CHW uint8": chw,
             "torch NCHW float": chw[None].float() / 255, "torch CHW RGBA": torch.from_numpy(rgba).permute(2, 0, 1),
             "list of PIL": [on_white.convert("RGB")], "list of tensors": [chw.float() / 255]}
    for channels in (1, 3):
        for name, form in forms.items():
            # Pillow rounds L and its alpha composite to 8-bit levels
            tolerance = 1.01 / 255 if channels == 1 or "RGBA" in name else 1e-6
            read = image_batch(form, channels)
            assert read.shape == (1, channels, 8, 12), name
            torch.testing.assert_close(read, expected[channels], atol=tolerance, rtol=0, msg=name)
    palette = on_white.convert("RGB").convert("P")  # its own colours, read through Pillow's convert
    for channels in (1, 3):
        torch.testing.assert_close(image_batch(palette, channels), image_batch(palette.convert("RGB"), channels))
    for form in (grey, torch.from_numpy(grey), Image.fromarray(grey), grey[:, :, None], torch.from_numpy(grey)[None]):
        torch.testing.assert_close(image_batch(form, 3), expected[1].expand(1, 3, 8, 12), atol=1e-6, rtol=0)
    assert image_batch([rgb, rgb[None]], 1).shape == (2, 1, 8, 12)
    for form, shape in ((rgb.transpose(2, 0, 1), "(3, 8, 12)"), (torch.from_numpy(rgb), "(8, 12, 3)"),
                        (torch.zeros(5, 8, 12), "(5, 8, 12)"), (np.zeros((2, 8, 12)), "(2, 8, 12)")):
        with pytest.raises(ValueError, match=rf"^image of shape {re.escape(shape)}: give "):
            image_batch(form, 1)
    with pytest.raises(ValueError, match=r"images of 2 sizes \(\(4, 4\), \(8, 12\)"):
        image_batch([rgb, rgb[:4, :4]], 1)


def test_a_grayscale_pipeline_given_an_rgb_tensor_makes_one_image_of_its_luminance():
    """A grayscale super-resolution pipeline given an RGB tensor [3, h, w]: one image (not a batch of
    three), the same as of that picture converted to L."""
    pipe = pipeline("super_resolution")
    rgb = random_uint8((4, 6, 3), seed=2)
    tensor = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255
    out = pipe(image=tensor, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
    grey = pipe(image=Image.fromarray(rgb).convert("L"), num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 8, 12, 1)
    np.testing.assert_allclose(out.images, grey.images, atol=0.02)


def test_num_images_per_prompt_samples_each_image_that_many_times_in_turn():
    """num_images_per_prompt n: image i's samples are outputs i n ... i n + n - 1, each the sample of
    that image with its own generator (as the images given n times each)."""
    pipe = pipeline("inpainting", channels=3)
    images = random_uint8((2, 8, 8, 3), seed=4)
    masks = np.zeros((2, 8, 8), np.float32)
    masks[0, :4], masks[1, :, 4:] = 1, 1

    def generators():
        return [torch.Generator().manual_seed(seed) for seed in range(6)]
    many = pipe(image=images, mask_image=masks[:, :, :, None], num_images_per_prompt=3, num_inference_steps=2,
                generator=generators(), output_type="np").images
    repeated = pipe(image=images.repeat(3, axis=0), mask_image=masks.repeat(3, axis=0)[:, :, :, None],
                    num_inference_steps=2, generator=generators(), output_type="np").images
    assert many.shape == (6, 8, 8, 3)
    np.testing.assert_allclose(many, repeated, atol=1e-6)
    assert not np.allclose(many[0], many[1])  # each its own noise


def test_the_image_processor_is_built_once_and_model_hooks_are_freed_after_decoding(monkeypatch):
    """The image processor is the pipeline's, built in __init__ (no new VaeImageProcessor in a call);
    maybe_free_model_hooks runs after the VAE has decoded, as diffusers' pipelines free them (an
    offloaded VAE freed before its decode would be loaded again)."""
    from diffusers import AutoencoderKL
    from helpers import TINY_VAE

    import diffusion_extras.evaluation.pipeline_image_conditioned as module

    vae = AutoencoderKL(**TINY_VAE).eval()
    unet = tiny_unet(2, sample_size=4, in_channels=4)
    pipe = ImageConditionedPipeline(unet, DDPMScheduler(num_train_timesteps=10), vae=vae, conditioning="image")
    pipe.set_progress_bar_config(disable=True)
    monkeypatch.setattr(module, "VaeImageProcessor", None)  # a call that built one would fail
    calls = []
    decode = vae.decode
    monkeypatch.setattr(vae, "decode", lambda *args, **kwargs: calls.append("decode") or decode(*args, **kwargs))
    monkeypatch.setattr(pipe, "maybe_free_model_hooks", lambda: calls.append("free"))
    pipe(image=random_uint8((8, 8, 3)), num_inference_steps=1)
    assert calls == ["decode", "free"]


def test_the_sample_channel_rule_inverts_the_condition_channel_rule_for_every_kind():
    """One rule for the channels of x_t in a conditioned UNet's input (the pipeline, the trainer's
    data channels and model line, a fine-tune's base): C samples plus condition_channels(kind, C)
    give C back, the trainer's `none` included; inpainting's mask is one channel more."""
    for kind in ("none", "super_resolution", "inpainting", "image"):
        for channels in (1, 2, 3, 4):
            assert sample_channels(kind, channels + condition_channels(kind, channels)) == channels, (kind, channels)
    assert [condition_channels(kind, 3) for kind in ("none", "super_resolution", "inpainting", "image")] == [0, 3, 4, 3]
    assert pipeline("inpainting", channels=3).sample_channels == 3
