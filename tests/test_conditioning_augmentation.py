"""Conditioning augmentation of super-resolution (--max_noise_level; training/step.py,
training/conditioning.py, the pipeline's noise_level): the low-resolution input noised to a level
drawn from (seed, micro-step) after every other draw, the level given to the UNet; the pipeline
noises its input alike; a resume is bit for bit; the refusals."""
import json
from types import SimpleNamespace

import faults
import pytest
import torch
from diffusers import DDPMScheduler
from helpers import assert_same_state, run_training, tiny_unet, write_tiny_recipe
from package_blocker import run_without_the_package

from diffusion_extras.core.timesteps import make_timestep_sampler
from diffusion_extras.evaluation.pipeline_image_conditioned import (
    ImageConditionedPipeline,
    degrade,
    noise_low_resolution,
    upsample,
)
from diffusion_extras.training.conditioning import ConditionNoise, ImageCondition
from diffusion_extras.training.config import ConfigError, TrainConfig, parse_config
from diffusion_extras.training.step import micro_step_randomness

SHAPE, LOW = (1, 8, 8), (1, 4, 4)


def fake_run(max_noise_level: int, rank: int = 0, num_processes: int = 1, batch: int = 4, seed: int = 7):
    """What micro_step_randomness reads of a super-resolution Run (condition drops on)."""
    return SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=rank),
        data=SimpleNamespace(global_micro_batch_size=batch * num_processes, class_names=None, posterior=None,
                             condition=object()),
        config=SimpleNamespace(seed=seed, offset_noise=0.0, conditioning_dropout_prob=0.3, train_batch_size=batch,
                               random_flip=True, max_noise_level=max_noise_level),
        objective=SimpleNamespace(timestep_sampler=make_timestep_sampler("uniform", 1000)))


def test_the_levels_and_noise_are_drawn_last_from_seed_and_micro_step():
    """Without augmentation nothing more is drawn; with it every earlier draw is the same, and the
    levels (0..max) and the noise are functions of (seed, micro-step), one rank's slice of the global batch."""
    plain = micro_step_randomness(fake_run(0), 5, SHAPE)
    augmented = micro_step_randomness(fake_run(300), 5, SHAPE, LOW)
    assert plain[-1] is None
    for before, after in zip(plain[:-1], augmented[:-1]):
        assert (before is None and after is None) or torch.equal(before, after)
    levels, noise = augmented[-1]
    assert levels.dtype == torch.long and noise.shape == (4, *LOW)
    assert 0 <= levels.min() and levels.max() <= 300 and len(levels.unique()) > 1
    again = micro_step_randomness(fake_run(300), 5, SHAPE, LOW)[-1]
    assert torch.equal(again.levels, levels) and torch.equal(again.noise, noise)
    assert not torch.equal(micro_step_randomness(fake_run(300), 6, SHAPE, LOW)[-1].noise, noise)
    assert not torch.equal(micro_step_randomness(fake_run(300, seed=8), 5, SHAPE, LOW)[-1].noise, noise)
    halves = [micro_step_randomness(fake_run(300, rank, 2, batch=2), 5, SHAPE, LOW)[-1] for rank in (0, 1)]
    one_rank = micro_step_randomness(fake_run(300, batch=4), 5, SHAPE, LOW)[-1]
    assert torch.equal(torch.cat([half.noise for half in halves]), one_rank.noise)


def test_the_noise_is_diffusers_low_resolution_noising_one_step_on():
    """Level L is DDPMScheduler().add_noise at timestep L - 1 (what diffusers' upscaler's
    low_res_scheduler does with noise_level L - 1); level 0 leaves the input as given."""
    images, noise = torch.rand(3, 1, 4, 4) * 2 - 1, torch.randn(3, 1, 4, 4)
    levels = torch.tensor([0, 1, 350])
    noised = noise_low_resolution(images, noise, levels)
    torch.testing.assert_close(noised[0], images[0], atol=0, rtol=0)
    expected = DDPMScheduler().add_noise(images[1:], noise[1:], levels[1:] - 1)
    torch.testing.assert_close(noised[1:], expected)


def test_training_noises_the_low_resolution_input_before_upsampling_it():
    pixels = torch.rand(2, 1, 8, 8) * 2 - 1
    condition = ImageCondition("super_resolution", 1, 0, 2, seed=0, max_noise_level=100)
    noise = ConditionNoise(torch.tensor([0, 60]), torch.randn(2, 1, 4, 4))
    _, augmented = condition.split(pixels, [], noise)
    _, plain = condition.split(pixels, [])
    torch.testing.assert_close(augmented[0], plain[0], atol=0, rtol=0)  # level 0: the input as given
    torch.testing.assert_close(augmented, upsample(noise_low_resolution(degrade(pixels, 2), noise.noise,
                                                                        noise.levels), 2))
    assert not torch.allclose(augmented[1], plain[1])


def augmented_pipeline(max_noise_level: int = 100) -> ImageConditionedPipeline:
    from diffusion_extras.training.models import build_noise_scheduler

    unet = tiny_unet(1, in_channels=2, class_embed_type="timestep" if max_noise_level else None)
    pipe = ImageConditionedPipeline(unet, build_noise_scheduler(TrainConfig(ddpm_num_steps=100)), sr_factor=2,
                                    max_noise_level=max_noise_level)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def unet_calls(pipe) -> list:
    """(the UNet's input, its class_labels) of each call."""
    calls = []
    pipe.unet.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args[0].clone(), kwargs.get("class_labels"))), with_kwargs=True)
    return calls


def test_the_pipeline_noises_its_input_to_noise_level_and_tells_the_unet():
    """noise_level L: the condition is the input noised to L with the generator's first draw, and the
    UNet gets L; default 20 (diffusers'); noise_level 0 draws nothing: its initial noise is that of
    the same seed's first draw and its condition the input as given."""
    low = torch.rand(2, 1, 4, 4)
    pipe = augmented_pipeline()
    calls = unet_calls(pipe)
    for level in ({}, {"noise_level": 0}, {"noise_level": 35}):
        pipe(image=low, num_inference_steps=1, generator=torch.Generator().manual_seed(3), **level)
    generator = torch.Generator().manual_seed(3)
    eps = torch.randn(low.shape, generator=generator)
    for (seen, labels), level in zip(calls, (20, 0, 35)):
        assert labels.tolist() == [level, level]
        noised = low * 2 - 1 if level == 0 else noise_low_resolution(low * 2 - 1, eps, torch.tensor([level] * 2))
        torch.testing.assert_close(seen[:, 1:], upsample(noised, 2))
    first = torch.randn((2, 1, 8, 8), generator=torch.Generator().manual_seed(3))
    scheduler = pipe.scheduler
    scheduler.set_timesteps(1)
    torch.testing.assert_close(calls[1][0][:, :1], scheduler.scale_model_input(first * scheduler.init_noise_sigma,
                                                                                scheduler.timesteps[0]))


def test_guidance_keeps_the_noise_level_in_both_branches():
    pipe = augmented_pipeline()
    calls = unet_calls(pipe)
    pipe(image=torch.rand(2, 1, 4, 4), num_inference_steps=1, guidance_scale=2.0, noise_level=7)
    assert calls[0][0].shape[0] == 4 and calls[0][1].tolist() == [7] * 4


def test_what_the_pipeline_refuses():
    with pytest.raises(ValueError, match="trained without conditioning augmentation"):
        augmented_pipeline(0)(image=torch.rand(1, 1, 4, 4), num_inference_steps=1, noise_level=20)
    with pytest.raises(ValueError, match=r"must lie in \[0, max_noise_level 100\]"):
        augmented_pipeline(100)(image=torch.rand(1, 1, 4, 4), num_inference_steps=1, noise_level=101)


@pytest.mark.parametrize("flags, message", [
    (("--conditioning", "inpainting", "--max_noise_level", "10"), "it is for --conditioning super_resolution"),
    (("--max_noise_level", "10"), "it is for --conditioning super_resolution"),
    (("--conditioning", "super_resolution", "--max_noise_level", "1000"), "use at most 999"),
    (("--conditioning", "super_resolution", "--max_noise_level", "-1"), "must be >= 0"),
])
def test_the_flag_is_refused_where_it_means_nothing(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--sr_factor", "2", *flags])


def test_a_model_config_that_takes_the_class_embedding_is_refused():
    from diffusion_extras.training.models import build_unet

    config = parse_config(["--conditioning", "super_resolution", "--sr_factor", "2", "--max_noise_level", "50",
                           "--resolution", "8"])
    model = {"in_channels": 1, "out_channels": 1, "block_out_channels": [8, 16], "norm_num_groups": 4,
             "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"]}
    assert build_unet(config, model).config.class_embed_type == "timestep"
    with pytest.raises(ConfigError, match="drop those from it"):
        build_unet(config, {**model, "num_class_embeds": 4})


# A process that cannot import the package: the augmented export upscales at its default noise level
# and at 0 and 80, and refuses 200.
BLOCKED_LOAD = """
import sys
import numpy as np, torch
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
low = np.random.default_rng(0).integers(0, 256, (4, 4), dtype=np.uint8)
outputs = [pipe(image=low, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np",
                **level).images for level in ({}, {"noise_level": 0}, {"noise_level": 80})]
assert all(o.shape == (1, 8, 8, 1) and np.isfinite(o).all() for o in outputs)
assert not np.array_equal(outputs[1], outputs[2])
try:
    pipe(image=low, num_inference_steps=1, noise_level=200)
except ValueError as error:
    print("refused:", error)
print(type(pipe).__name__, pipe.config.max_noise_level)
"""


@pytest.fixture(scope="module")
def augmented_run(tmp_path_factory):
    """3 steps of augmented 2x super-resolution on the digits: a held-out tenth, the gradient probe,
    a grid (sampled through the pipeline) and the export."""
    folder = tmp_path_factory.mktemp("augmented")
    recipe = write_tiny_recipe(folder, save_images_steps=3, eval_batch_size=4, validation_split=0.1,
                               grad_diagnostics_steps=3, validation_steps=3)
    run_training(recipe, folder / "run", "--conditioning", "super_resolution", "--sr_factor", 2,
                 "--max_noise_level", 100, "--max_train_steps", 3)
    return folder / "run"


@pytest.mark.xdist_group("test_conditioning_augmentation.augmented_run")
def test_the_export_records_the_level_and_samples_with_noise_level_without_the_package(augmented_run, tmp_path):
    index = json.loads((augmented_run / "model_index.json").read_text())
    assert index["max_noise_level"] == 100
    assert json.loads((augmented_run / "unet" / "config.json").read_text())["class_embed_type"] == "timestep"
    assert (augmented_run / "samples" / "step_000003.png").is_file()
    result = run_without_the_package(BLOCKED_LOAD, tmp_path, augmented_run)
    assert "refused: noise_level=200: it must lie in [0, max_noise_level 100]" in result.stdout
    assert "ImageConditionedPipeline 100" in result.stdout


def test_a_resumed_augmented_run_is_bit_exact(tiny_recipe, tmp_path):
    """Stopped by a signal after step 3 and resumed to 6 (an epoch boundary crossed), with drops and
    flips: it ends where a straight run does, the levels and their noise drawn alike."""
    recipe = tiny_recipe(checkpointing_steps=3, max_train_samples=32)
    flags = ("--conditioning", "super_resolution", "--sr_factor", 2, "--max_noise_level", 200,
             "--conditioning_dropout_prob", 0.3, "--random_flip", "--max_train_steps", 6)
    run_training(recipe, tmp_path / "straight", *flags)
    stopped = run_training(recipe, tmp_path / "resumed", *flags, hooks=faults.hooks(signal_at_step=3), check=False)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    resumed = run_training(recipe, tmp_path / "resumed", *flags, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0
    assert_same_state(tmp_path / "straight", tmp_path / "resumed", 6)
    changed = run_training(recipe, tmp_path / "resumed", *flags[:-1], 8, "--max_noise_level", 100,
                           "--resume_from_checkpoint", "latest", check=False)  # its resume policy: refuse
    assert changed.returncode != 0 and "max_noise_level" in changed.stderr, changed.stderr[-2000:]


@pytest.mark.xdist_group("test_conditioning_augmentation.augmented_run")
def test_the_commands_take_noise_level(augmented_run, tmp_path):
    """`sample --noise_level N` gives the inputs at level N (the default is the pipeline's, 20; another
    level samples other images); `evaluate` reports the level it scored at."""
    import numpy as np
    from helpers import run_cli
    from PIL import Image

    low = tmp_path / "low"
    low.mkdir()
    for index in range(2):
        pixels = np.random.default_rng(index).integers(0, 256, (4, 4), dtype=np.uint8)
        Image.fromarray(pixels).save(low / f"{index}.png")
    made = {}
    for level in (None, 20, 80):
        out = tmp_path / f"out-{level}"
        run_cli(["-m", "diffusion_extras.sample", augmented_run, "--conditioning_images", low, "--output", out,
                 "--num_inference_steps", 2, *(["--noise_level", level] if level is not None else [])])
        made[level] = [np.asarray(Image.open(out / f"{index:06d}.png")) for index in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(made[None], made[20]))
    assert not all(np.array_equal(a, b) for a, b in zip(made[20], made[80]))
    for level, flags in ((80, ["--noise_level", 80]), (20, [])):
        run_cli(["-m", "diffusion_extras.evaluate", augmented_run, "--reference", tmp_path / "out-80",
                 "--feature_extractor", "tiny", "--eval_metrics", "fid", "--num_inference_steps", 2, *flags,
                 "--output", tmp_path / "report.json"])
        assert json.loads((tmp_path / "report.json").read_text())["noise_level"] == level


@pytest.mark.xdist_group("test_conditioning_augmentation.augmented_run")
def test_the_model_card_gives_the_noise_level_and_its_call_runs(augmented_run, tmp_path, monkeypatch):
    """The card of an augmented export says what noise_level is and calls the pipeline with it; the
    call runs as written against the folder."""
    import numpy as np
    from PIL import Image

    from diffusion_extras.hub.push import write_model_card

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    index = json.loads((augmented_run / "model_index.json").read_text())
    card = write_model_card(str(augmented_run), {"repo_id": str(augmented_run), "conditioning": {
        key: index[key] for key in ("conditioning", "sr_factor", "conditioning_dropout_prob", "max_noise_level")}})
    text = open(card).read()
    assert "inputs were noised to levels 0 to 100" in text
    code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
    assert "noise_level=20" in code
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "low_resolution.png")
    exec(compile(code.replace("num_inference_steps=50", "num_inference_steps=2"), "model card", "exec"), {})
    assert Image.open(tmp_path / "result.png").size == (8, 8)
