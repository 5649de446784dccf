"""Guided sampling against an exact score: a fake UNet whose epsilon prediction is the analytic one
of a two-class Gaussian mixture (class 0 dark, class 1 bright), so that which class a sample lands
in is known without training. Guidance must strengthen the class with every scheduler a user swaps
in from the pipeline's config (DDIM's inherited clip_sample once inverted it)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from diffusers import (
    ConfigMixin,
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LMSDiscreteScheduler,
    ModelMixin,
)
from diffusers.configuration_utils import register_to_config
from diffusers.models.unets.unet_2d import UNet2DOutput
from helpers import run_cli, run_training
from PIL import Image

from diffusion_extras.evaluation import sampling
from diffusion_extras.evaluation.pipeline_class_conditional import (
    DEFAULT_GUIDANCE_SCALE,
    ClassConditionalPipeline,
    noise_level,
)

MEANS = (-0.5, 0.5)  # per-pixel means of the two classes, in the [-1, 1] data range
STD = 0.5  # per-pixel standard deviation within a class: wide enough that guided x0 estimates leave [-1, 1]


class MixtureEpsilon(ModelMixin, ConfigMixin):
    """The exact epsilon of x0 ~ N(MEANS[k], STD^2 I) for class k, and of their equal mixture for the
    "no class" label 2: x_t ~ N(sqrt(a) mu_k, (a STD^2 + 1 - a) I), eps = sqrt(1-a) (x_t - sqrt(a) mu_k) / var,
    mixed with the classes' posterior weights. `offset` shifts both means (a weaker guide)."""

    @register_to_config
    def __init__(self, sample_size: int = 4, in_channels: int = 1, out_channels: int = 1, num_class_embeds: int = 3,
                 offset: float = 0.0):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a dtype and a device for the pipeline to read
        self.register_buffer("alphas_cumprod", DDPMScheduler().alphas_cumprod.double(), persistent=False)

    def forward(self, sample, timestep, class_labels=None, return_dict=True):
        a = self.alphas_cumprod[torch.as_tensor(timestep).long()].reshape(-1, 1, 1, 1)
        x = sample.double()
        variance = a * STD ** 2 + 1 - a
        means = [m + self.config.offset for m in MEANS]
        per_class = [(1 - a).sqrt() * (x - a.sqrt() * m) / variance for m in means]
        log_likelihood = torch.stack([-((x - a.sqrt() * m) ** 2).flatten(1).sum(1) / (2 * variance.flatten())
                                      for m in means], dim=1)
        weights = log_likelihood.softmax(dim=1).reshape(-1, 2, 1, 1, 1)
        mixture = weights[:, 0] * per_class[0] + weights[:, 1] * per_class[1]
        labels = torch.full((len(x),), 2) if class_labels is None else class_labels.reshape(-1).cpu()
        pick = labels.reshape(-1, 1, 1, 1)
        eps = torch.where(pick == 0, per_class[0], torch.where(pick == 1, per_class[1], mixture))
        output = eps.to(sample.dtype) + 0 * self.anchor
        return UNet2DOutput(sample=output) if return_dict else (output,)


def class_of(images: torch.Tensor) -> torch.Tensor:
    """The class whose mean is nearer: bright images (mean above 0 in [-1, 1]) are class 1."""
    return (images.flatten(1).mean(1) > 0).long()


SWAPPED_IN = [DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler]
LABELS = [0, 1] * 16


def pipeline_accuracy(scheduler_class, guidance_scale: float, **call) -> float:
    training = DDPMScheduler()  # clip_sample=True: what the trainer exports, and what from_config inherits
    pipe = ClassConditionalPipeline(unet=MixtureEpsilon(), scheduler=training, id2label={0: "dark", 1: "bright"})
    pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config)  # as users swap schedulers
    pipe.set_progress_bar_config(disable=True)
    images = pipe(class_labels=LABELS, guidance_scale=guidance_scale, num_inference_steps=20,
                  generator=torch.manual_seed(0), output_type="pt", **call).images
    return float((class_of(images * 2 - 1) == torch.tensor(LABELS)).float().mean())


@pytest.mark.parametrize("scheduler_class", SWAPPED_IN, ids=lambda c: c.__name__)
def test_guidance_keeps_the_class_with_any_scheduler_swapped_into_the_pipeline(scheduler_class):
    """A DDIM step that clips the guided x0 but builds x_{t-1} from the unclipped noise prediction
    (which points at the other class) keeps the class at guidance 2 and 3 and loses it at 4."""
    accuracy = [pipeline_accuracy(scheduler_class, scale) for scale in (2.0, 3.0, 4.0)]
    assert accuracy == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", sampling.SCHEDULERS)
def test_generate_keeps_the_class_under_guidance(name):
    """The sampler behind `python -m diffusion_extras.sample`, the in-training grids and FID."""
    scheduler = sampling.make_scheduler(name, DDPMScheduler().config)
    images = sampling.generate(MixtureEpsilon(), scheduler, len(LABELS), 20, seed=0, class_labels=LABELS,
                               guidance_scale=4.0)
    assert ((torch.from_numpy(images).float().flatten(1).mean(1) > 127.5).long() == torch.tensor(LABELS)).all()


def sample_pipeline(pipe, guidance_scale=3.0, **call) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return pipe(class_labels=LABELS[:4], guidance_scale=guidance_scale, num_inference_steps=10,
                generator=torch.manual_seed(0), output_type="pt", **call).images


def conditional_pipeline(**parts) -> ClassConditionalPipeline:
    from helpers import tiny_unet
    unet = tiny_unet(num_class_embeds=3)
    return ClassConditionalPipeline(unet=unet, scheduler=DDIMScheduler.from_config(DDPMScheduler().config),
                                    id2label={0: "dark", 1: "bright"}, **parts)


# Every scheduler diffusers lists as compatible with the trainer's DDPM config (what a user may swap
# in), less those whose optional dependency is missing here (DPMSolverSDEScheduler needs torchsde).
# sorted: `compatibles` is built from a set, whose order differs between processes (pytest-xdist's
# workers must collect the same tests in the same order)
COMPATIBLE = sorted((cls for cls in DDPMScheduler().compatibles
                     if not cls.__module__.startswith("diffusers.utils.dummy")), key=lambda cls: cls.__name__)


@pytest.mark.parametrize("scheduler_class", COMPATIBLE, ids=lambda c: c.__name__)
def test_every_compatible_scheduler_samples_guided_and_unguided_reproducibly(scheduler_class):
    """The pipeline and the package's sampler (its unconditional path included) pass a scheduler's step
    only the keyword arguments it accepts: UniPC, PNDM, DEIS, Heun, LMS and KDPM2 take no generator.
    The same seeded generator gives the same images, so the ancestral ones do get it."""
    from helpers import tiny_unet
    pipe = conditional_pipeline()
    pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    for scale in (1.0, 3.0):
        runs = [pipe(class_labels=[0, 1], guidance_scale=scale, num_inference_steps=4, output_type="pt",
                     generator=torch.Generator().manual_seed(0)).images for _ in range(2)]
        torch.manual_seed(1)  # a dropped generator would draw from the global RNG, which moves on
        assert runs[0].shape == (2, 1, 8, 8) and torch.isfinite(runs[0]).all() and torch.equal(*runs)
    unconditional = [sampling.generate(tiny_unet(), pipe.scheduler, 2, 4, seed=0) for _ in range(2)]
    assert unconditional[0].shape == (2, 8, 8, 1) and (unconditional[0] == unconditional[1]).all()


def test_an_interval_covering_every_noise_level_is_cfg_bit_for_bit_and_outside_it_one_unguided_call():
    pipe = conditional_pipeline()
    everywhere = sample_pipeline(pipe, guidance_interval=(0.0, float("inf")))
    assert torch.equal(everywhere, sample_pipeline(pipe))
    assert torch.equal(sample_pipeline(pipe, guidance_interval=(1e9, 2e9)), sample_pipeline(pipe, guidance_scale=1.0))
    batches = []
    pipe.unet.register_forward_pre_hook(lambda module, args: batches.append(len(args[0])))
    middle = (0.5, 5.0)  # Kynkäänniemi et al.'s kind of interval: neither the noisiest nor the cleanest steps
    sample_pipeline(pipe, guidance_interval=middle)
    sigmas = [noise_level(pipe.scheduler, step) for step in range(len(pipe.scheduler.timesteps))]
    assert batches == [8 if middle[0] < sigma <= middle[1] else 4 for sigma in sigmas] and 8 in batches and 4 in batches


# Karras sigmas (fractional timesteps between the table's entries) where the scheduler keeps a sigma per
# step; KDPM2 with Karras sigmas rounds its timesteps (diffusers), so there t and x_t's sigma disagree.
KARRAS = [EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, LMSDiscreteScheduler, HeunDiscreteScheduler,
          DPMSolverMultistepScheduler]


@pytest.mark.parametrize("scheduler_class, options", [(cls, {}) for cls in COMPATIBLE]
                         + [(cls, {"use_karras_sigmas": True}) for cls in KARRAS],
                         ids=lambda value: value.__name__ if isinstance(value, type) else ("karras" if value else ""))
def test_the_noise_level_of_a_step_is_the_one_the_scheduler_uses(scheduler_class, options):
    """Where a scheduler scales its input by 1 / sqrt(sigma^2 + sigma_data^2) (Euler, Heun, LMS, KDPM2
    and their ancestral kinds, EDM's Euler), the guidance interval's sigma of each step is that sigma,
    KDPM2's interpolated second evaluations included; elsewhere its own sigmas (DPM-Solver, UniPC,
    DEIS), else alpha_bar of the integer timestep (DDPM, DDIM, PNDM)."""
    scheduler = scheduler_class.from_config(DDPMScheduler().config, **options)
    scheduler.set_timesteps(6)
    sigma_data = scheduler.config.get("sigma_data", 1.0)
    sample = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    for step, t in enumerate(scheduler.timesteps):
        scale = float((scheduler.scale_model_input(sample, t) / sample).flatten()[0])
        sigma = noise_level(scheduler, step)
        if scale != 1.0:
            assert (sigma ** 2 + sigma_data ** 2) ** -0.5 == pytest.approx(scale, rel=1e-5), (step, float(t))
        elif hasattr(scheduler, "sigmas"):
            assert sigma == float(scheduler.sigmas[step])
        else:
            alpha_bar = float(scheduler.alphas_cumprod[int(t)])
            assert float(t) == int(t) and sigma == pytest.approx(math.sqrt((1 - alpha_bar) / alpha_bar), rel=1e-6)
        sample = scheduler.step(torch.zeros_like(sample), t, sample).prev_sample


def test_the_interval_reads_sigma_from_the_schedulers_sigmas_not_from_the_integer_part_of_t():
    """Euler with Karras sigmas steps at fractional timesteps: alpha_bar at int(t) reads a lower sigma.
    An interval whose lower end lies between the two readings of one step tells them apart."""
    pipe = conditional_pipeline()
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    pipe.scheduler.set_timesteps(10)
    sigmas = [float(sigma) for sigma in pipe.scheduler.sigmas[:-1]]
    truncated = [math.sqrt((1 - a) / a) for a in (float(pipe.scheduler.alphas_cumprod[int(t)])
                                                  for t in pipe.scheduler.timesteps)]
    step = max(range(len(sigmas) - 1), key=lambda i: sigmas[i] / truncated[i])  # not the last (sigma 0.03)
    interval = ((sigmas[step] + truncated[step]) / 2, math.inf)
    batches = []
    pipe.unet.register_forward_pre_hook(lambda module, args: batches.append(len(args[0])))
    sample_pipeline(pipe, guidance_interval=interval)
    assert batches == [8 if interval[0] < sigma else 4 for sigma in sigmas]
    assert batches != [8 if interval[0] < sigma else 4 for sigma in truncated]


def test_a_guide_equal_to_the_model_is_no_guidance_bit_for_bit():
    pipe = conditional_pipeline()
    pipe.guide = pipe.unet
    assert torch.equal(sample_pipeline(pipe, guidance_scale=3.0), sample_pipeline(pipe, guidance_scale=1.0))
    assert not torch.equal(sample_pipeline(pipe, autoguidance=False), sample_pipeline(pipe, guidance_scale=1.0))


def test_autoguidance_of_an_unconditional_model_through_generate():
    """The same with the package's sampler and an unconditional UNet; a different guide does guide."""
    from helpers import tiny_unet
    unet, weaker = tiny_unet(seed=0), tiny_unet(seed=1)
    scheduler = sampling.make_scheduler("ddim", DDPMScheduler().config)
    plain = sampling.generate(unet, scheduler, 2, 5, seed=0)
    assert (sampling.generate(unet, scheduler, 2, 5, seed=0, guide=unet, guidance_scale=3.0) == plain).all()
    assert (sampling.generate(unet, scheduler, 2, 5, seed=0, guide=weaker, guidance_scale=3.0) != plain).any()


def test_a_saved_guide_loads_with_the_pipeline(tmp_path):
    from helpers import tiny_unet
    pipe = conditional_pipeline(guide=tiny_unet(num_class_embeds=3, seed=1))
    pipe.save_pretrained(tmp_path)
    loaded = ClassConditionalPipeline.from_pretrained(tmp_path)
    assert loaded.guide is not None and torch.equal(sample_pipeline(loaded), sample_pipeline(pipe))
    without = conditional_pipeline()
    without.save_pretrained(tmp_path / "plain")
    assert ClassConditionalPipeline.from_pretrained(tmp_path / "plain").guide is None
    with pytest.raises(ValueError, match="autoguidance=True needs a guide"):
        sample_pipeline(without, autoguidance=True)


def saved_with_a_guide(folder) -> ClassConditionalPipeline:
    """The README's recipe: a weaker UNet set as the guide, then save_pretrained."""
    from helpers import tiny_unet
    pipe = conditional_pipeline()
    pipe.guide = tiny_unet(num_class_embeds=3, seed=1)
    pipe.save_pretrained(folder)
    return pipe


def test_a_guide_set_then_saved_round_trips_through_remote_code_and_a_resave(tmp_path):
    """diffusers re-registered the unset optional guide as None (no guide/ written), wrote
    `_class_name` as a bare string and no pipeline file: the folder then failed
    DiffusionPipeline.from_pretrained(..., trust_remote_code=True). Re-saving a loaded pipeline (the
    trainer's export included) must keep all three."""
    from diffusers import DiffusionPipeline
    pipe = saved_with_a_guide(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_class_conditional", "ClassConditionalPipeline"]
    assert index["guide"] == ["diffusers", "UNet2DModel"] and (tmp_path / "saved" / "guide").is_dir()
    assert (tmp_path / "saved" / "pipeline_class_conditional.py").is_file()
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    assert type(loaded).__name__ == "ClassConditionalPipeline" and loaded.guide is not None
    assert torch.equal(sample_pipeline(loaded), sample_pipeline(pipe))  # autoguided by the saved guide
    loaded.save_pretrained(tmp_path / "resaved")
    again = DiffusionPipeline.from_pretrained(tmp_path / "resaved", trust_remote_code=True)
    assert torch.equal(sample_pipeline(again), sample_pipeline(pipe))
    pipe.guide = None  # and a guide taken away is not saved
    pipe.save_pretrained(tmp_path / "unguided")
    assert ClassConditionalPipeline.from_pretrained(tmp_path / "unguided").guide is None
    assert not (tmp_path / "unguided" / "guide").exists()


def test_the_sample_command_autoguides_with_a_saved_guide(tmp_path):
    """It loaded such a folder as an unconditional DDPMPipeline, without a word."""
    pipe = saved_with_a_guide(tmp_path / "saved")
    argv = ["-m", "diffusion_extras.sample", tmp_path / "saved", "--num_images", "4", "--num_inference_steps", "3",
            "--device", "cpu"]
    result = run_cli([*argv, "--output", tmp_path / "out"])
    written = np.stack([np.asarray(Image.open(tmp_path / "out" / f"{i:06d}.png")) for i in range(4)])
    expected = sampling.generate(pipe.unet, sampling.make_scheduler("ddim", pipe.scheduler.config), 4, 3, seed=0,
                                 class_labels=[0, 1, 0, 1], guidance_scale=DEFAULT_GUIDANCE_SCALE, guide=pipe.guide)
    assert (written == expected[..., 0]).all()
    assert "wrote 4 images" in result.stdout
    # a folder whose index names the class alone (as save_pretrained wrote it) is not a DDPMPipeline either
    index_path = tmp_path / "saved" / "model_index.json"
    index_path.write_text(json.dumps({**json.loads(index_path.read_text()), "_class_name": "ClassConditionalPipeline"}))
    run_cli([*argv, "--output", tmp_path / "bare"])
    assert all((np.asarray(Image.open(tmp_path / "bare" / f"{i:06d}.png")) == written[i]).all() for i in range(4))


def test_a_hub_push_takes_the_guide(tmp_path):
    from diffusion_extras.hub.push import HubPusher
    saved_with_a_guide(tmp_path / "saved")
    pusher = HubPusher.__new__(HubPusher)  # the file selection alone: no repository, no network
    pusher.folder = str(tmp_path / "saved")
    assert {"guide/config.json", "guide/diffusion_pytorch_model.safetensors", "pipeline_class_conditional.py",
            "model_index.json"} <= set(pusher.pipeline_files())


@pytest.mark.parametrize("mismatch, message", [
    ({"out_channels": 2}, r"out_channels 2 \(the model's: 1\)"),  # a learned-variance guide: a traceback mid-sampling
    ({"sample_size": 16}, r"sample_size 16 \(the model's: 8\)"),
    ({"num_class_embeds": 5}, r"classes 4 \(the model's: 2\)"),  # the "no class" indices
])
def test_a_guide_that_does_not_fit_the_model_is_one_line_at_assignment_and_at_load(tmp_path, mismatch, message):
    from helpers import tiny_unet
    pipe = conditional_pipeline()
    with pytest.raises(ValueError, match=f"^the guide does not fit the model: its {message}; .*same kind"):
        pipe.guide = tiny_unet(**{"num_class_embeds": 3, **mismatch})
    assert pipe.guide is None
    saved_with_a_guide(tmp_path / "saved")
    tiny_unet(**{"num_class_embeds": 3, **mismatch}).save_pretrained(tmp_path / "saved" / "guide")  # swapped in on disk
    with pytest.raises(ValueError, match=message):
        ClassConditionalPipeline.from_pretrained(tmp_path / "saved")


def test_the_commands_refuse_a_guide_of_another_kind_in_one_line(tmp_path):
    """--guide of another prediction type (recorded by its pipeline's scheduler) or shape answers with
    one line naming the mismatch, before any sampling."""
    from helpers import tiny_unet
    saved_with_a_guide(tmp_path / "model")
    other = ClassConditionalPipeline(unet=tiny_unet(num_class_embeds=3, seed=2),
                                     scheduler=DDPMScheduler(prediction_type="v_prediction"), id2label={0: "a", 1: "b"})
    other.save_pretrained(tmp_path / "v")
    tiny_unet(num_class_embeds=3, out_channels=2).save_pretrained(tmp_path / "learned_variance")
    argv = ["-m", "diffusion_extras.sample", tmp_path / "model", "--num_images", "2", "--num_inference_steps", "2",
            "--device", "cpu", "--output", tmp_path / "out"]
    for guide, message in [("v", "it predicts v_prediction and the model epsilon"),
                           ("v/unet", "it predicts v_prediction and the model epsilon"),
                           ("learned_variance", "out_channels 2 (the model's: 1)")]:
        result = run_cli([*argv, "--guide", tmp_path / guide], check=False)
        error = result.stderr
        assert result.returncode == 2 and error.startswith(f"error: --guide {tmp_path / guide}: ")
        assert message in error and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_training_checkpoint_guides_with_its_ema_weights(tmp_path, tiny_recipe, fresh_accelerate, capsys):
    """--guide run/checkpoint-N took accelerate's raw weights, where Karras et al. and bench/quality.py
    guide with EMA weights: now the EMA's (those the run's exported pipeline holds), saying so; the raw
    ones only for a run that kept no EMA."""
    import shutil

    from safetensors.torch import load_file

    from diffusion_extras.cli.common import load_guide
    run = tmp_path / "run"
    run_training(tiny_recipe(), run, "--class_conditional", "--max_train_steps", 2, "--checkpointing_steps", 2)
    exported = ClassConditionalPipeline.from_pretrained(run).unet  # EMA weights at step 2
    guide = load_guide(str(run / "checkpoint-2"), exported, "cpu", "epsilon")
    assert capsys.readouterr().err == f"--guide {run / 'checkpoint-2'}: the checkpoint's EMA weights\n"
    assert all(torch.equal(value, exported.state_dict()[name]) for name, value in guide.state_dict().items())
    raw = load_file(run / "checkpoint-2" / "model.safetensors")
    assert not all(torch.equal(value, raw[name]) for name, value in guide.state_dict().items())
    without_ema = tmp_path / "checkpoint-without-ema"
    shutil.copytree(run / "checkpoint-2", without_ema)
    state = json.loads((without_ema / "train_state.json").read_text())
    state["config"]["use_ema"] = False
    (without_ema / "train_state.json").write_text(json.dumps(state))
    guide = load_guide(str(without_ema), exported, "cpu", "epsilon")
    assert "the checkpoint's raw weights (the run kept no EMA)" in capsys.readouterr().err
    assert all(torch.equal(value, raw[name]) for name, value in guide.state_dict().items())


def test_guidance_is_refused_on_an_export_trained_without_condition_dropout(tiny_recipe, tmp_path):
    """Guidance weighs the prediction against the one without the condition, which only condition
    dropout trains. The trainer's export records the dropout (an image-conditioned run's
    --conditioning_dropout_prob, a class-conditional run's --condition_dropout); with 0 recorded,
    guidance_scale != 1 is one line naming guidance_scale, in the pipeline and in both commands,
    before any sampling; 1, or a dropout > 0, or autoguidance, samples. An export from before the
    record (None) guides as asked."""
    from diffusion_extras.cli.common import load_pipeline
    from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline

    image_run, class_run = tmp_path / "sr", tmp_path / "classes"
    run_training(tiny_recipe(), image_run, "--conditioning", "super_resolution", "--sr_factor", 2,
                 "--max_train_steps", 1)
    run_training(tiny_recipe(class_conditional=True, condition_dropout=0.0, guidance_scale=1.0), class_run,
                 "--max_train_steps", 1)
    assert json.loads((image_run / "model_index.json").read_text())["conditioning_dropout_prob"] == 0.0
    assert json.loads((class_run / "model_index.json").read_text())["condition_dropout"] == 0.0
    low = np.zeros((1, 4, 4, 1), np.uint8)
    sr = load_pipeline(str(image_run))
    with pytest.raises(ValueError, match=r"^guidance_scale=3: this model was trained with "
                                         r"--conditioning_dropout_prob 0, so its prediction without the condition"):
        sr(image=low, num_inference_steps=1, guidance_scale=3)
    sr(image=low, num_inference_steps=1, guidance_scale=1)
    classes = load_pipeline(str(class_run))
    with pytest.raises(ValueError, match=r"^guidance_scale=2: this model was trained with --condition_dropout 0"):
        classes(class_labels=[1], num_inference_steps=1)  # the default scale, 2
    classes(class_labels=[1], num_inference_steps=1, guidance_scale=1)
    classes.guide = classes.unet  # autoguidance does not use the "no class" embedding
    classes(class_labels=[1], num_inference_steps=1, guidance_scale=3)
    for dropout in (0.1, None):  # trained with dropout; an export from before the record
        unconditioned = ImageConditionedPipeline(sr.unet, sr.scheduler, conditioning="super_resolution", sr_factor=2,
                                                 conditioning_dropout_prob=dropout)
        unconditioned(image=low, num_inference_steps=1, guidance_scale=3)
        ClassConditionalPipeline(classes.unet, classes.scheduler, {0: "a"}, condition_dropout=dropout)(
            class_labels=[0], num_inference_steps=1, guidance_scale=3)
    low_folder = tmp_path / "low"
    low_folder.mkdir()
    Image.fromarray(low[0, :, :, 0]).save(low_folder / "0.png")
    evaluate = ["--reference", low_folder, "--feature_extractor", "tiny"]
    for command, run, flags in (("sample", image_run, ["--conditioning_images", low_folder]),
                                ("evaluate", image_run, evaluate), ("sample", class_run, []),
                                ("evaluate", class_run, evaluate)):
        result = run_cli(["-m", f"diffusion_extras.{command}", run, "--guidance_scale", 3, *flags, "--output",
                          tmp_path / "out", "--num_inference_steps", 1], check=False)
        assert result.returncode == 2, (command, run, result.stderr[-500:])
        assert result.stderr.strip().splitlines()[-1].startswith("error: guidance_scale=3: this model was trained"), \
            (command, run, result.stderr[-500:])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--sr_factor", "2"], "--sr_factor is read with --conditioning super_resolution: add it, or drop --sr_factor"),
    (["--condition_dropout", "0.2"], "--condition_dropout is read with --class_conditional"),
    (["--guidance_scale", "3"], "--guidance_scale is read with --class_conditional or --conditioning"),
    (["--class_conditional", "--condition_dropout", "0"],
     "--guidance_scale 2 guides with the 'no class' prediction, which --condition_dropout 0 never trains"),
    (["--conditioning", "inpainting", "--guidance_scale", "2"],
     "--guidance_scale 2 guides on the image with the prediction without it, which --conditioning_dropout_prob 0"),
])
def test_the_trainer_refuses_flags_that_mean_nothing_for_the_run_and_guidance_without_dropout(flags, message):
    from diffusion_extras.training.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(flags)
    parse_config({"--sr_factor": ["--conditioning", "super_resolution", "--sr_factor", "2"],
                  "--condition_dropout": ["--class_conditional", "--condition_dropout", "0.2"],
                  "--guidance_scale": ["--class_conditional", "--guidance_scale", "3"],
                  "--class_conditional": ["--class_conditional", "--condition_dropout", "0", "--guidance_scale", "1"],
                  "--conditioning": ["--conditioning", "inpainting", "--guidance_scale", "2",
                                     "--conditioning_dropout_prob", "0.1"]}[flags[0]])  # where they belong: taken
