"""Conditioning on images (--conditioning; training/conditioning.py, data/conditioning.py): what
each kind gives the UNet in the step, the exported ImageConditionedPipeline (loaded without the
package), the grids, the monitors, and the refusals."""
import contextlib
import io
import json
import shutil

import numpy as np
import pytest
import torch
from helpers import (
    first_step_inputs,
    load_unet_weights,
    read_history,
    run_training,
    save_tiny_pipeline,
    tiny_run,
    write_tiny_recipe,
)
from package_blocker import run_without_the_package
from PIL import Image

from diffusion_extras.data import batch_order, decode_cache
from diffusion_extras.data import images as data
from diffusion_extras.evaluation.pipeline_image_conditioned import degrade, upsample
from diffusion_extras.training.conditioning import ImageCondition, conditions_of
from diffusion_extras.training.config import ConfigError, parse_config

# A process that cannot import the package, as a user without it installed: the super-resolution
# export loads with trust_remote_code and doubles a 4x6 image with DDIM and Euler.
BLOCKED_LOAD = """
import sys
import numpy as np, torch
from diffusers import DiffusionPipeline, EulerDiscreteScheduler
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
low = np.random.default_rng(0).integers(0, 256, (4, 6), dtype=np.uint8)
for scheduler in ("DDPMScheduler", "EulerDiscreteScheduler"):
    if scheduler == "EulerDiscreteScheduler":
        pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    images = pipe(image=low, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (1, 8, 12, 1) and np.isfinite(images).all(), images.shape
print(type(pipe).__name__, pipe.config.conditioning, pipe.config.sr_factor)
"""


@pytest.fixture(scope="module")
def super_resolution_run(tmp_path_factory):
    """3 steps of 2x super-resolution on the digits (tiny recipe), a held-out tenth, the gradient
    probe, a grid of 4 conditions and the export at the end; --background black (the digits are
    opaque: only the export's record of it changes)."""
    folder = tmp_path_factory.mktemp("super_resolution")
    recipe = write_tiny_recipe(folder, save_images_steps=3, eval_batch_size=4, validation_split=0.1,
                               grad_diagnostics_steps=3, validation_steps=3)
    run_training(recipe, folder / "run", "--conditioning", "super_resolution", "--sr_factor", 2, "--max_train_steps", 3,
                 "--background", "black")
    return folder / "run"


SR_RUN = pytest.mark.xdist_group("test_conditioning.super_resolution_run")


@SR_RUN
def test_the_export_is_an_image_conditioned_pipeline_with_its_files(super_resolution_run):
    index = json.loads((super_resolution_run / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_image_conditioned", "ImageConditionedPipeline"]
    assert (index["conditioning"], index["sr_factor"], index["vae"]) == ("super_resolution", 2, [None, None])
    assert index["background"] == [0, 0, 0]  # transparent inputs are composited on it, as training's were
    for name in ("pipeline_image_conditioned.py", "pipeline_class_conditional.py", "pipeline_latent.py"):
        assert (super_resolution_run / name).is_file(), name
    unet = json.loads((super_resolution_run / "unet" / "config.json").read_text())
    assert (unet["in_channels"], unet["out_channels"]) == (2, 1)  # x_t and the upsampled low resolution
    scheduler = json.loads((super_resolution_run / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["prediction_type"] == "v_prediction"  # super-resolution's default


@SR_RUN
def test_the_grid_shows_condition_sample_and_target_and_the_monitors_see_conditions(super_resolution_run):
    """4 held-out digits, 2 triplets a row; the held-out loss and the gradient probe ran (with the
    condition: the UNet takes 2 channels)."""
    with Image.open(super_resolution_run / "samples" / "step_000003.png") as grid:
        assert grid.size == (2 + 6 * (8 + 2), 2 + 2 * (8 + 2))
        cells = np.asarray(grid)
    history = {key: value for row in read_history(super_resolution_run) for key, value in row.items()}
    assert np.isfinite(history["validation/raw_loss"]) and np.isfinite(history["grad_probe/total_norm"])
    # the first triplet: the bicubic condition and the target of the first held-out digit
    recipe = str(next(super_resolution_run.parent.glob("*.yaml")))
    dataset = data.load_image_dataset(parse_config(["--config", recipe]))
    decoded = decode_cache.decode_dataset(dataset, "image", 8, True, 1)
    first = batch_order.split_held_out(decoded, 0.1, 0)[1].image(0).transpose(2, 0, 1)[None]
    shown = conditions_of(ImageCondition("super_resolution", 1, 0, 2, 0), first, 0)
    assert np.array_equal(cells[2:10, 2:10], (shown["shown"][0, 0] * 255).round().numpy().astype(np.uint8))
    assert np.array_equal(cells[2:10, 22:30], first[0, 0])


@SR_RUN
def test_the_export_loads_without_the_package_and_upscales(super_resolution_run, tmp_path):
    result = run_without_the_package(BLOCKED_LOAD, tmp_path, super_resolution_run)
    assert "ImageConditionedPipeline super_resolution 2" in result.stdout


@pytest.mark.usefixtures("fresh_accelerate")
def test_the_unet_sees_x_t_then_the_bicubic_upsampling_of_its_degraded_image(tmp_path):
    """One step of a super-resolution run with flips: after the noisy image, the UNet's input holds
    upsample(degrade(image)) of the very image (flipped as it is) it denoises."""
    cleans, inputs = first_step_inputs(tmp_path, "--conditioning", "super_resolution", "--sr_factor", 2,
                                       "--random_flip")
    assert inputs[0].shape == (8, 2, 8, 8)
    torch.testing.assert_close(inputs[0][:, 1:], upsample(degrade(cleans[0], 2), 2))
    assert not torch.allclose(inputs[0][:, 1:], upsample(degrade(cleans[0].flip(-1), 2), 2))


@pytest.mark.parametrize("flags, message", [
    (["--conditioning", "super_resolution", "--class_conditional"], "does not combine with --class_conditional"),
    (["--conditioning", "super_resolution", "--sr_factor", "3"], "--resolution 16 is not a multiple of --sr_factor 3"),
    (["--conditioning", "super_resolution", "--sr_factor", "1"], "--sr_factor must be at least 2"),
    (["--mask_column", "m"], "--mask_column is read with --conditioning inpainting"),
    (["--conditioning", "image"], "give --conditioning_image_column"),
    (["--conditioning", "image", "--conditioning_data_dir", "."], "pairs its files with --train_data_dir's"),
    (["--conditioning_dropout_prob", "0.1"], "drops an image condition: add --conditioning"),
    (["--conditioning", "inpainting", "--keep_alpha"], "drop --keep_alpha"),
])
def test_what_the_config_refuses(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(flags)


@pytest.mark.parametrize("flags, predicts", [
    (["--conditioning", "super_resolution"], "v_prediction"),
    (["--conditioning", "super_resolution", "--prediction_type", "epsilon"], "epsilon"),
    (["--conditioning", "inpainting"], "epsilon"), ([], "epsilon")])
def test_super_resolution_predicts_v_unless_told(flags, predicts):
    """Not given, --prediction_type follows --conditioning super_resolution (v: an epsilon upscaler's
    DDIM samples drift in colour) and stays not given, so a fine-tune's base can set it."""
    config = parse_config(flags)
    assert config.prediction_type == predicts
    assert ("prediction_type" in config.given) == ("--prediction_type" in flags)


@pytest.mark.usefixtures("fresh_accelerate")
def test_fine_tuning_an_unconditional_pipeline_widens_its_input_with_zeros(tmp_path):
    """An unconditional DDPMPipeline fine-tuned for super-resolution: conv_in gains the condition's
    channel with zero weights, so before the first step the UNet predicts what the base predicts
    whatever the condition; the step then trains those weights."""
    from diffusers import UNet2DModel

    from diffusion_extras.training import loop, step
    base = save_tiny_pipeline(tmp_path / "base")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run = tiny_run(tmp_path, "--pretrained_model_name_or_path", base, "--conditioning", "super_resolution",
                       "--sr_factor", 2)
    assert "its input widened by 1 zero-initialised channel(s) for the super_resolution condition" in \
        printed.getvalue()
    widened = run.accelerator.unwrap_model(run.learner.unet)
    original = UNet2DModel.from_pretrained(base, subfolder="unet").eval()
    sample, condition = (torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(k)) for k in (0, 1))
    with torch.no_grad():
        before = widened.eval()(torch.cat([sample, condition], 1), torch.tensor(30)).sample
        torch.testing.assert_close(before, original(sample, torch.tensor(30)).sample, atol=1e-6, rtol=1e-6)
    assert widened.config.in_channels == 2 and not widened.conv_in.weight[:, 1:].any()
    # the base's objective, not super-resolution's default
    assert run.config.prediction_type == "epsilon" and "super-resolution predicts" not in printed.getvalue()
    widened.train()
    batches = loop.make_batches(run)
    for _ in range(2):  # the first step's learning rate is the warmup's 0
        step.optimizer_step(run, batches)
    run.accelerator.end_training()
    assert widened.conv_in.weight[:, 1:].abs().sum() > 0


@SR_RUN
def test_fine_tuning_an_image_conditioned_export_keeps_its_kind(super_resolution_run, tmp_path, tiny_recipe):
    """A super-resolution export fine-tunes as one (its kind and factor taken, no widening); another
    kind is refused in one line."""
    result = run_training(tiny_recipe(), tmp_path / "tuned", "--pretrained_model_name_or_path", super_resolution_run,
                   "--max_train_steps", 1)
    assert "widened" not in result.stdout
    index = json.loads((tmp_path / "tuned" / "model_index.json").read_text())
    assert (index["conditioning"], index["sr_factor"]) == ("super_resolution", 2)
    refused = run_training(tiny_recipe(), tmp_path / "other", "--pretrained_model_name_or_path",
                           super_resolution_run, "--conditioning", "inpainting", "--max_train_steps", 1, check=False)
    assert refused.returncode == 2
    assert "its UNet is conditioned for super_resolution: fine-tune it with --conditioning super_resolution" in \
        refused.stderr.strip().splitlines()[-1]


@SR_RUN
def test_a_fine_tune_of_an_image_conditioned_export_resumes_exactly(super_resolution_run, tmp_path, tiny_recipe):
    """The resume takes the base's kind and factor from the checkpoint's record (the base's weights
    are gone by then) and ends bit for bit where the straight fine-tune does."""
    base = tmp_path / "base"
    shutil.copytree(super_resolution_run, base, ignore=shutil.ignore_patterns("checkpoint-*", "samples", "logs"))
    recipe, flags = tiny_recipe(checkpointing_steps=2), ["--pretrained_model_name_or_path", base]
    run_training(recipe, tmp_path / "straight", *flags, "--max_train_steps", 4)
    run_training(recipe, tmp_path / "resumed", *flags, "--max_train_steps", 2)
    (base / "unet" / "diffusion_pytorch_model.safetensors").unlink()  # a resume must not need them
    result = run_training(recipe, tmp_path / "resumed", *flags, "--max_train_steps", 4, "--resume_from_checkpoint",
                          "latest")
    assert "resumed from" in result.stdout
    index = json.loads((tmp_path / "resumed" / "model_index.json").read_text())
    assert (index["conditioning"], index["sr_factor"]) == ("super_resolution", 2)
    straight, resumed = (load_unet_weights(tmp_path / name) for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.usefixtures("fresh_accelerate")
def test_dropped_conditions_are_zeros_drawn_per_image(tmp_path):
    """--conditioning_dropout_prob 0.5: some images of the step see a zero condition (dropped for
    guidance on the image), the others their own."""
    cleans, inputs = first_step_inputs(tmp_path, "--conditioning", "super_resolution", "--sr_factor", 2,
                                       "--conditioning_dropout_prob", 0.5)
    condition, expected = inputs[0][:, 1:], upsample(degrade(cleans[0], 2), 2)
    dropped = (condition == 0).flatten(1).all(1)
    assert 0 < dropped.sum() < len(dropped)
    torch.testing.assert_close(condition[~dropped], expected[~dropped])


@SR_RUN
def test_the_model_card_says_what_the_model_does_and_its_call_runs_as_written(super_resolution_run, tmp_path,
                                                                            monkeypatch):
    """The card of the super-resolution export (as the Hub push writes it, from the run's model_card
    info): image-to-image, a 2x super-resolution model; its usage block runs against the folder."""
    from diffusion_extras.hub.push import write_model_card
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    card = write_model_card(str(super_resolution_run), {"repo_id": str(super_resolution_run), "conditioning": {
        "conditioning": "super_resolution", "sr_factor": 2}})
    text = open(card).read()
    assert "pipeline_tag: image-to-image" in text and "super-resolution" in text
    assert "A 2x super-resolution model" in text
    code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.zeros((4, 6), np.uint8)).save(tmp_path / "low_resolution.png")
    code = code.replace("num_inference_steps=50", "num_inference_steps=2")
    exec(compile(code, "model card", "exec"), {})
    with Image.open(tmp_path / "result.png") as image:
        assert image.size == (12, 8)
