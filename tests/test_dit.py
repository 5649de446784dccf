"""--model_type dit (training/dit.py, training/backbones.py) and its export (evaluation/pipeline_dit.py):
sizes by the paper's names, the DiT's quirks behind the backbone seam (evaluation/pipeline_backbone.py),
training in-process, the export against a hand loop and loaded without the package, exact resume,
and the refusals."""
import json

import faults
import numpy as np
import pytest
import torch
import yaml
from helpers import TINY_DIT, TINY_RECIPE, assert_same_state, run_training, save_tiny_dit_config
from package_blocker import run_without_the_package

from diffusion_extras.core.choices import DIT_SIZES
from diffusion_extras.training import dit
from diffusion_extras.training.config import ConfigError, TrainConfig, parse_config


@pytest.fixture(scope="module")
def tiny_dit_config(tmp_path_factory):
    """A DiTTransformer2DModel config.json (TINY_DIT), as --model_config_name_or_path takes it."""
    return save_tiny_dit_config(tmp_path_factory.mktemp("tiny_dit"))


def dit_recipe(folder, config_folder, **overrides) -> str:
    """The tiny recipe without its UNet (`model:`), with --model_type dit and the tiny DiT's config."""
    values = {key: value for key, value in TINY_RECIPE.items() if key != "model"}
    values.update(model_type="dit", model_config_name_or_path=config_folder, **overrides)
    path = folder / "dit.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


# ----------------------------------------------------------------------------- sizes
# Peebles & Xie 2023, Table 1 (depth, hidden size, heads) and Table 4's parameters of the /2 models
# (256 px: 32x32x4 latents, 1000 classes, learned sigma), in millions.
PAPER = {"S": (12, 384, 6, 33), "B": (12, 768, 12, 130), "L": (24, 1024, 16, 458), "XL": (28, 1152, 16, 675)}


@pytest.mark.parametrize("size", DIT_SIZES)
def test_a_size_by_name_is_the_papers_depth_width_heads_and_patch(size):
    name, patch = size.split("/")
    config = TrainConfig(model_type="dit", dit_size=size, resolution=32)
    values = dit.follow_data(config, 3).model
    depth, width, heads, _ = PAPER[name]
    assert (values["num_layers"], values["num_attention_heads"] * values["attention_head_dim"],
            values["num_attention_heads"], values["patch_size"]) == (depth, width, heads, int(patch))


@pytest.mark.parametrize("name", PAPER)
def test_the_slash_2_models_have_the_papers_parameters(name):
    # diffusers gives every block its own copy of DiT's one timestep and label embedder (the weights
    # converted from the paper's checkpoints are equal copies): counted once, the paper's figure
    from accelerate import init_empty_weights
    from diffusers import DiTTransformer2DModel
    config = TrainConfig(model_type="dit", dit_size=f"{name}/2", resolution=32, variance_type="learned_range")
    values = dit.follow_data(config, 4, class_names=[str(i) for i in range(1000)]).model
    assert values["out_channels"] == 8 and values["num_embeds_ada_norm"] == 1000
    with init_empty_weights():
        model = DiTTransformer2DModel(**values)
    embedder = sum(p.numel() for p in model.transformer_blocks[0].norm1.emb.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert round((total - (values["num_layers"] - 1) * embedder) / 1e6) == PAPER[name][3]


@pytest.mark.parametrize("side,shape,patch", [(16, dit.SMALL_DIT, 2), (32, dit.SMALL_DIT, 2),
                                              (64, dit.DIT_SHAPES["S"], 4), (256, dit.DIT_SHAPES["S"], 8)])
def test_with_no_size_the_dit_follows_the_data(side, shape, patch):
    values = dit.follow_data(TrainConfig(model_type="dit", resolution=side), 1).model
    assert (values["num_layers"], values["num_attention_heads"] * values["attention_head_dim"],
            values["num_attention_heads"]) == shape
    assert values["patch_size"] == patch and values["sample_size"] == side
    assert values["num_embeds_ada_norm"] == 1  # unconditional: one class, trained as "no class"


# ----------------------------------------------------------------------------- the quirks, behind the seam
def test_the_built_dit_drops_no_labels_and_draws_nothing_from_the_global_rng():
    from diffusion_extras.evaluation.pipeline_backbone import predict
    config = TrainConfig(model_type="dit", resolution=8, class_conditional=True)
    choice = dit.follow_data(config, 1, class_names=["a", "b", "c"])
    model = dit.build_dit(config, {**choice.model, **TINY_DIT}).train()
    x, t, labels = torch.randn(64, 1, 8, 8), torch.randint(0, 1000, (64,)), torch.zeros(64, dtype=torch.long)
    state = torch.get_rng_state()
    with torch.no_grad():
        first, second = predict(model, x, t, labels), predict(model, x, t, labels)
    assert torch.equal(torch.get_rng_state(), state)  # diffusers' default draws torch.rand per block
    assert torch.equal(first, second)  # (with its 0.1 dropout some of 64 labels would be dropped)


def test_predict_gives_a_dit_one_timestep_per_image_and_its_own_no_class():
    from diffusers import DiTTransformer2DModel

    from diffusion_extras.evaluation.pipeline_backbone import null_class, predict, sample_shape
    torch.manual_seed(0)
    model = DiTTransformer2DModel(in_channels=1, sample_size=8, num_embeds_ada_norm=3, **TINY_DIT).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        expected = model(x, torch.tensor([7, 7]), class_labels=torch.tensor([3, 3])).sample
        assert torch.equal(predict(model, x, torch.tensor(7)), expected)  # a sampler's 0-d t, no labels
    assert null_class(model) == 3 and sample_shape(model) == (1, 8, 8)


# ----------------------------------------------------------------------------- training and the export
# the tests of `trained` on one xdist worker (--dist loadgroup), so that its two runs are made once
TRAINED = pytest.mark.xdist_group("test_dit.trained")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dit_config):
    """{"unconditional" | "classes": the output folder of 3 steps of the tiny DiT on the digits (the
    class-conditional one with post-hoc EMA snapshots)}."""
    runs = {}
    for kind, flags in (("unconditional", []),
                        ("classes", ["--class_conditional", "--posthoc_ema", "--posthoc_ema_snapshot_steps", 1])):
        folder = tmp_path_factory.mktemp(f"dit_{kind}")
        result = run_training(dit_recipe(folder, tiny_dit_config), folder / "run", "--max_train_steps", 3, *flags)
        assert "DiT depth 2, width 32, 2 heads, patch 2 (4x4 tokens)" in result.stdout
        runs[kind] = folder / "run"
    return runs


@TRAINED
def test_a_dit_run_exports_a_dit_pipeline_with_its_classes(trained):
    for kind, classes in (("unconditional", 1), ("classes", 10)):
        index = json.loads((trained[kind] / "model_index.json").read_text())
        assert index["_class_name"] == ["pipeline_dit", "DiTClassPipeline"]
        assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
        config = json.loads((trained[kind] / "transformer" / "config.json").read_text())
        assert config["num_embeds_ada_norm"] == classes and config["sample_size"] == 8
        assert len(index["id2label"]) == (10 if kind == "classes" else 0)
        losses = [json.loads(line)["loss"] for line in (trained[kind] / "logs" / "history.jsonl").read_text().split(
            "\n") if '"loss"' in line]
        assert len(losses) == 3 and all(np.isfinite(losses))


def hand_loop(transformer, scheduler, labels, guidance_scale: float, steps: int, seed: int) -> torch.Tensor:
    """DiT sampling written out: x_T from the seed, one call on [labels; "no class"] a step, guided
    eps = u + s (c - u), the scheduler's step with the same generator."""
    generator = torch.manual_seed(seed)
    scheduler.set_timesteps(steps)
    size = transformer.config.sample_size
    x = torch.randn((len(labels), transformer.config.in_channels, size, size), generator=generator)
    x = x * scheduler.init_noise_sigma
    null = torch.full_like(labels, transformer.config.num_embeds_ada_norm)
    for t in scheduler.timesteps:
        with torch.no_grad():
            out = transformer(torch.cat([x, x]), t.repeat(2 * len(labels)), class_labels=torch.cat([labels, null]))
        conditional, unconditional = out.sample.chunk(2)
        x = scheduler.step(unconditional + guidance_scale * (conditional - unconditional), t, x,
                           generator=generator).prev_sample
    return (x / 2 + 0.5).clamp(0, 1)


@TRAINED
def test_the_export_samples_as_the_hand_loop_and_loads_without_the_package(trained, tmp_path):
    from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
    pipe = DiTClassPipeline.from_pretrained(trained["classes"])
    labels = pipe.get_label_ids(["3", "7"])
    images = pipe(class_labels=labels, guidance_scale=3.0, num_inference_steps=4, generator=torch.manual_seed(1),
                  output_type="pt").images
    expected = hand_loop(pipe.transformer, type(pipe.scheduler).from_config(pipe.scheduler.config),
                         torch.tensor(labels), 3.0, 4, 1)
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
    np.save(tmp_path / "expected.npy", images.permute(0, 2, 3, 1).numpy())
    run_without_the_package(
        "import sys, numpy as np, torch\n"
        "from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler\n"
        "pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "images = pipe(class_labels=pipe.get_label_ids(['3', '7']), guidance_scale=3.0, num_inference_steps=4,\n"
        "              generator=torch.manual_seed(1), output_type='np').images\n"
        "assert np.abs(images - np.load(sys.argv[2])).max() < 1e-6, 'not the package pipeline samples'\n"
        "pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)\n"
        "assert pipe(class_labels=[0], num_inference_steps=3, output_type='np').images.shape == (1, 8, 8, 1)\n",
        tmp_path, trained["classes"], tmp_path / "expected.npy")


@TRAINED
def test_an_unconditional_export_samples_its_no_class_model(trained):
    from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
    pipe = DiTClassPipeline.from_pretrained(trained["unconditional"])
    images = pipe(batch_size=2, num_inference_steps=3, generator=torch.manual_seed(0), output_type="pt").images
    expected = hand_loop(pipe.transformer, type(pipe.scheduler).from_config(pipe.scheduler.config),
                         torch.tensor([1, 1]), 1.0, 3, 0)  # guidance 1: the "no class" branch alone
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="unconditional"):
        pipe(class_labels=[0])
    with pytest.raises(ValueError, match='^output_type "latent" is for a DiT trained on a VAE'):
        pipe(batch_size=1, output_type="latent")


@TRAINED
def test_sample_evaluate_and_posthoc_ema_take_a_dit_export(trained, tmp_path):
    """The commands load a DiT export as its DiTClassPipeline: `sample` writes the images the
    pipeline makes for those classes and seeds (guided with the model's own "no class"), `evaluate`
    scores class-balanced samples, `posthoc_ema` exports a DiT pipeline around the reconstructed
    transformer."""
    from helpers import run_cli
    from PIL import Image

    from diffusion_extras.core.phema import reconstruct
    from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
    from diffusion_extras.evaluation.sampling import image_seed, make_scheduler

    run = trained["classes"]
    run_cli(["-m", "diffusion_extras.sample", run, "--class_labels", "3,7", "--num_images", 2,
             "--num_inference_steps", 3, "--seed", 4, "--output", tmp_path / "samples"])
    written = np.stack([np.asarray(Image.open(path)) for path in sorted((tmp_path / "samples").glob("0*.png"))])
    pipe = DiTClassPipeline.from_pretrained(run)
    pipe.scheduler = make_scheduler(None, pipe.scheduler.config)  # the command's default: DDIM
    expected = pipe(class_labels=[3, 7], num_inference_steps=3, output_type="np",
                    generator=[torch.Generator().manual_seed(image_seed(4, i)) for i in range(2)]).images
    assert written.shape == (2, 8, 8)
    assert np.abs(written.astype(int) - (expected[..., 0] * 255).round().astype(int)).max() <= 1
    (tmp_path / "reference").mkdir()
    for index in range(10):
        Image.fromarray(np.random.default_rng(index).integers(0, 256, (8, 8), dtype=np.uint8)).save(
            tmp_path / "reference" / f"{index}.png")
    run_cli(["-m", "diffusion_extras.evaluate", run, "--reference", tmp_path / "reference", "--feature_extractor",
             "tiny", "--num_samples", 10, "--num_inference_steps", 2, "--output", tmp_path / "report.json"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_classes"] == 10 and np.isfinite(report["fid"])
    run_cli(["-m", "diffusion_extras.posthoc_ema", run, "--sigma_rels", "0.1", "--export", tmp_path / "best"])
    best = DiTClassPipeline.from_pretrained(tmp_path / "best")
    assert best.id2label == pipe.id2label
    state = reconstruct(str(run / "posthoc_ema"), 0.1)
    for name, parameter in best.transformer.named_parameters():
        assert torch.equal(parameter, state[name].to(parameter.dtype)), name


@TRAINED
def test_autoguidance_with_a_weaker_dit_guides_against_its_class_prediction(trained, tmp_path):
    """pipe.guide = a weaker DiT (here one of the same shape with other weights): each step guides the
    model's class prediction against the guide's for the same class, g + s (c - g), as the loop
    written out; saved, the guide comes back with the folder; `sample --guide` with the guide's
    folder makes the pipeline's images; a guide with another number of classes is one line."""
    from diffusers import DiTTransformer2DModel
    from helpers import run_cli
    from PIL import Image

    from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
    from diffusion_extras.evaluation.sampling import image_seed, make_scheduler
    pipe = DiTClassPipeline.from_pretrained(trained["classes"])
    torch.manual_seed(5)
    guide = DiTTransformer2DModel.from_config(pipe.transformer.config).eval()
    pipe.guide = guide
    labels, scale = torch.tensor([3, 7]), 2.0
    images = pipe(class_labels=labels.tolist(), guidance_scale=scale, num_inference_steps=3,
                  generator=torch.manual_seed(1), output_type="pt").images
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(3)
    generator = torch.manual_seed(1)
    x = torch.randn((2, 1, 8, 8), generator=generator) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        with torch.no_grad():
            strong = pipe.transformer(x, t.repeat(2), class_labels=labels).sample
            weak = guide(x, t.repeat(2), class_labels=labels).sample
        x = scheduler.step(weak + scale * (strong - weak), t, x, generator=generator).prev_sample
    torch.testing.assert_close(images, (x / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)
    pipe.save_pretrained(tmp_path / "guided")
    assert isinstance(DiTClassPipeline.from_pretrained(tmp_path / "guided").guide, DiTTransformer2DModel)
    guide.save_pretrained(tmp_path / "guide")
    run_cli(["-m", "diffusion_extras.sample", trained["classes"], "--class_labels", "3", "--num_images", 2,
             "--guide", tmp_path / "guide", "--num_inference_steps", 3, "--seed", 4, "--output", tmp_path / "samples"])
    written = np.stack([np.asarray(Image.open(path)) for path in sorted((tmp_path / "samples").glob("0*.png"))])
    pipe.scheduler = make_scheduler(None, pipe.scheduler.config)  # the command's default: DDIM
    expected = pipe(class_labels=[3, 3], guidance_scale=2.0, num_inference_steps=3, output_type="np",
                    generator=[torch.Generator().manual_seed(image_seed(4, i)) for i in range(2)]).images
    assert np.abs(written.astype(int) - (expected[..., 0] * 255).round().astype(int)).max() <= 1
    with pytest.raises(ValueError, match=r"^the guide does not fit the model: its classes 1 \(the model's: 10\)"):
        pipe.guide = DiTClassPipeline.from_pretrained(trained["unconditional"]).transformer


def test_a_latent_dit_exports_its_vae_and_samples_decoded_images_without_the_package(tmp_path):
    """A class-conditional DiT on a VAE's latents (2 x 4 x 4 from 8 px): the DiT follows the latents
    (their channels and side), the export is a DiTClassPipeline with vae/, whose images are its
    latents decoded (decode_latents, as the latent UNet pipeline), guided, loaded without the
    package and with another scheduler; `sample` writes decoded 8 px images and `posthoc_ema` keeps
    the VAE beside the averaged transformer."""
    from helpers import run_cli, save_tiny_vae
    from PIL import Image

    from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
    from diffusion_extras.evaluation.pipeline_latent import decode_latents
    values = {key: value for key, value in TINY_RECIPE.items() if key != "model"}
    recipe = tmp_path / "dit.yaml"
    recipe.write_text(yaml.safe_dump({**values, "model_type": "dit"}))
    vae = save_tiny_vae(tmp_path / "vae", in_channels=1, out_channels=1)
    run = tmp_path / "run"
    result = run_training(str(recipe), run, "--class_conditional", "--pretrained_vae_model_name_or_path", vae,
                          "--max_train_steps", 2, "--posthoc_ema", "--posthoc_ema_snapshot_steps", 1)
    assert "2 channel(s) (latents of the VAE" in result.stdout and "(2x2 tokens)" in result.stdout
    index = json.loads((run / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["_class_name"] == ["pipeline_dit", "DiTClassPipeline"]
    pipe = DiTClassPipeline.from_pretrained(run)
    assert (pipe.transformer.config.in_channels, pipe.transformer.config.sample_size) == (2, 4)
    call = dict(class_labels=[3, 7], guidance_scale=3.0, num_inference_steps=3)
    latents = pipe(**call, generator=torch.manual_seed(1), output_type="latent").images
    images = pipe(**call, generator=torch.manual_seed(1), output_type="np").images
    assert latents.shape == (2, 2, 4, 4) and images.shape == (2, 8, 8, 1)
    decoded = (decode_latents(pipe.vae, latents) / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(images, decoded, rtol=0, atol=1e-6)
    np.save(tmp_path / "expected.npy", images)
    run_without_the_package(
        "import sys, numpy as np, torch\n"
        "from diffusers import DiffusionPipeline, DDIMScheduler\n"
        "pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "images = pipe(class_labels=[3, 7], guidance_scale=3.0, num_inference_steps=3,\n"
        "              generator=torch.manual_seed(1), output_type='np').images\n"
        "assert np.abs(images - np.load(sys.argv[2])).max() < 1e-6, 'not the package pipeline samples'\n"
        "pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)\n"
        "assert pipe(class_labels=[0], num_inference_steps=2, output_type='np').images.shape == (1, 8, 8, 1)\n",
        tmp_path, run, tmp_path / "expected.npy")
    run_cli(["-m", "diffusion_extras.sample", run, "--class_labels", "3", "--num_images", 1,
             "--num_inference_steps", 2, "--output", tmp_path / "samples"])
    assert [np.asarray(Image.open(path)).shape for path in sorted((tmp_path / "samples").glob("0*.png"))] == [(8, 8)]
    run_cli(["-m", "diffusion_extras.posthoc_ema", run, "--sigma_rels", "0.1", "--export", tmp_path / "best"])
    assert type(DiTClassPipeline.from_pretrained(tmp_path / "best").vae).__name__ == "AutoencoderKL"


def test_a_dit_run_resumes_bit_for_bit(tmp_path, tiny_dit_config):
    recipe = dit_recipe(tmp_path, tiny_dit_config, lr_scheduler="cosine", variance_type="learned_range")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ("--max_train_steps", 4, "--checkpointing_steps", 2, "--class_conditional")
    run_training(recipe, straight, *flags)
    with pytest.raises(faults.ProcessDied):
        run_training(recipe, resumed, *flags, hooks=faults.hooks(stop_after_checkpoint=2))
    run_training(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, resumed, 4)


def test_sit_a_dit_on_flow_matching_resumes_bit_for_bit_and_samples_the_guided_euler_flow(tmp_path,
                                                                                          tiny_dit_config):
    """SiT (Ma et al. 2024: DiT with flow matching): a killed class-conditional DiT flow run, and one
    preempted by a SIGTERM, resume bit for bit; its export steps with FlowMatchEulerDiscreteScheduler,
    and its images are the Euler loop written out: x from unit noise, the velocity guided against
    the "no class" index at timestep sigma x 1000, x += (sigma_next - sigma) v, down to sigma 0. Its
    checkpoint loads as a guide (a DiT with that step's EMA weights)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
    recipe = dit_recipe(tmp_path, tiny_dit_config)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ("--objective", "flow_matching", "--class_conditional", "--max_train_steps", 4, "--checkpointing_steps", 2)
    run_training(recipe, straight, *flags)
    with pytest.raises(faults.ProcessDied):
        run_training(recipe, resumed, *flags, hooks=faults.hooks(stop_after_checkpoint=2))
    run_training(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, resumed, 4)
    preempted = tmp_path / "preempted"  # a SIGTERM after step 1: checkpoint-1 saved, exit 4
    result = run_training(recipe, preempted, *flags, hooks=faults.hooks(signal_at_step=1), check=False)
    assert result.returncode == 4 and (preempted / "checkpoint-1").is_dir()
    run_training(recipe, preempted, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, preempted, 4)
    pipe = DiTClassPipeline.from_pretrained(straight)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    labels, scale, steps = torch.tensor([3, 7]), 2.0, 3
    images = pipe(class_labels=labels.tolist(), guidance_scale=scale, num_inference_steps=steps,
                  generator=torch.manual_seed(1), output_type="pt").images
    x = torch.randn((2, 1, 8, 8), generator=torch.manual_seed(1))
    sigmas = torch.linspace(1.0, 1 / 1000, steps, dtype=torch.float64).tolist() + [0.0]
    null = torch.full_like(labels, pipe.transformer.config.num_embeds_ada_norm)
    for sigma, following in zip(sigmas[:-1], sigmas[1:]):
        with torch.no_grad():
            out = pipe.transformer(torch.cat([x, x]), torch.full((4,), sigma * 1000),
                                   class_labels=torch.cat([labels, null]))
        conditional, unconditional = out.sample.chunk(2)
        x = x + (following - sigma) * (unconditional + scale * (conditional - unconditional))
    torch.testing.assert_close(images, (x / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-5)
    # a checkpoint of the run guides it (--guide run/checkpoint-N): a DiT with that step's EMA weights
    from diffusion_extras.cli.common import load_guide
    from diffusion_extras.training.checkpointing import EMA_STATE
    guide = load_guide(str(straight / "checkpoint-2"), pipe.transformer, "cpu")
    shadow = torch.load(straight / "checkpoint-2" / EMA_STATE, weights_only=True)["shadow_params"]
    assert all(torch.equal(parameter, value) for parameter, value in zip(guide.parameters(), shadow, strict=True))


def test_gradient_checkpointing_on_a_dit_recomputes_and_trains_as_without(tmp_path, tiny_dit_config):
    """--gradient_checkpointing turns diffusers' checkpointing of the DiT's blocks on, and the run's
    losses and weights are those of the run without it, bit for bit."""
    from helpers import load_unet_weights, read_history

    from diffusion_extras.training.hooks import Hooks
    recipe = dit_recipe(tmp_path, tiny_dit_config)
    seen = []
    hooks = Hooks(after_step=lambda run: seen.append(
        run.accelerator.unwrap_model(run.learner.unet).is_gradient_checkpointing))
    run_training(recipe, tmp_path / "plain", "--max_train_steps", 3)
    run_training(recipe, tmp_path / "checkpointed", "--max_train_steps", 3, "--gradient_checkpointing", hooks=hooks)
    assert seen == [True] * 3
    plain, checkpointed = (read_history(tmp_path / name) for name in ("plain", "checkpointed"))
    assert [h["loss"] for h in plain if "loss" in h] == [h["loss"] for h in checkpointed if "loss" in h]
    a, b = load_unet_weights(tmp_path / "plain"), load_unet_weights(tmp_path / "checkpointed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_compiled_dit_step_stays_compiled(tmp_path, tiny_dit_config):
    """The whole step compiled on a class-conditional DiT (eager backend: the graphs inductor would
    get), with accumulation 2, EMA and FID at steps 2 and 6: the step's five graphs, no break, and no
    graph after warm-up but the final grid's capture of the sampling copy (as test_compile's runs)."""
    from test_compile import CHEAP_COMPILE, STEP_GRAPHS, assert_stays_compiled, counted_run
    counts = counted_run(tmp_path, *CHEAP_COMPILE, "--use_ema", "--gradient_accumulation_steps", 2, "--eval_steps", 2,
                         "--feature_extractor", "tiny", "--eval_num_samples", 4, "--class_conditional",
                         "--max_train_steps", 6, model=None, model_type="dit",
                         model_config_name_or_path=tiny_dit_config, save_images_steps=1000,
                         lr_scheduler="constant_with_warmup")
    assert_stays_compiled(counts, until=6)
    assert counts[1]["graphs"] == STEP_GRAPHS and counts["end"]["graphs"] == STEP_GRAPHS + 2, counts


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("flags,message", [
    (["--conditioning", "super_resolution"], "--conditioning super_resolution with --model_type dit"),
    (["--resolution", "16,32"], "--resolution 16x32 with --model_type dit: a DiT unpatchifies square images"),
    (["--dit_size", "M/2"], "--dit_size 'M/2' is not one of: S/2"),
    (["--pretrained_model_name_or_path", "facebook/DiT-XL-2-256", "--dit_size", "S/2"],
     "--pretrained_model_name_or_path brings its DiT's shape: drop --dit_size"),
])
def test_what_a_dit_is_not_built_for_is_refused_before_training(flags, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        parse_config(["--model_type", "dit", *flags])


def test_a_dit_size_without_a_dit_and_a_unet_shape_with_one_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="^--dit_size S/2 sizes a DiT: add --model_type dit"):
        parse_config(["--dit_size", "S/2"])
    recipe = tmp_path / "unet.yaml"
    recipe.write_text(yaml.safe_dump({"model": TINY_RECIPE["model"]}))
    with pytest.raises(ConfigError, match=r"^a recipe's `model:` mapping \(block_out_channels, ...\) shapes a UNet"):
        parse_config(["--config", str(recipe), "--model_type", "dit"])


def test_a_config_file_of_the_other_kind_is_refused_in_one_line(tmp_path, tiny_dit_config):
    from helpers import tiny_unet
    tiny_unet().save_config(tmp_path / "unet")
    recipe = dit_recipe(tmp_path, str(tmp_path / "unet"))
    result = run_training(recipe, tmp_path / "a", check=False)
    assert result.returncode == 2 and "a UNet2DModel config, and --model_type dit builds a DiTTransformer2DModel" \
        in result.stderr and "Traceback" not in result.stderr
    result = run_training(recipe, tmp_path / "b", "--model_type", "unet", "--model_config_name_or_path",
                          tiny_dit_config, check=False)
    assert result.returncode == 2 and "a DiTTransformer2DModel config: add --model_type dit" in result.stderr


@TRAINED
@pytest.mark.usefixtures("fresh_accelerate")
def test_this_trainers_dit_export_fine_tunes_onto_classes(trained, tmp_path):
    """An unconditional DiT export fine-tuned on the digits' ten classes: its "no class" row becomes
    every class's start (and stays "no class"); the class-conditional export keeps its own ten rows.
    The run is a DiT run without --model_type."""
    from diffusers import DiTTransformer2DModel
    from helpers import tiny_run

    from diffusion_extras.training import pretrained
    table = "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"
    for kind in ("unconditional", "classes"):
        base = DiTTransformer2DModel.from_pretrained(trained[kind], subfolder="transformer").state_dict()[table]
        run = tiny_run(tmp_path, "--pretrained_model_name_or_path", trained[kind], "--class_conditional",
                       output_dir=tmp_path / kind, model=None)
        model = run.accelerator.unwrap_model(run.learner.unet)
        assert isinstance(model, DiTTransformer2DModel) and run.config.model_type == "dit"
        expected = base[-1:].expand(11, -1) if kind == "unconditional" else base
        assert torch.equal(model.state_dict()[table], expected), kind
        run.accelerator.end_training()
    assert pretrained.load(str(trained["classes"])).subfolder == "transformer"


@TRAINED
def test_the_model_card_names_the_transformer_and_its_call_runs_as_written(trained, tmp_path, monkeypatch):
    """A DiT export's card says what the model is (a diffusion transformer, not a UNet), names its
    pipeline file, and its usage block runs against the folder: with classes (by name, guided) and
    without."""
    from diffusion_extras.hub.push import write_model_card

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.chdir(tmp_path)
    for kind, class_names in (("classes", [str(k) for k in range(10)]), ("unconditional", None)):
        text = open(write_model_card(str(trained[kind]), {"repo_id": str(trained[kind]), "class_names": class_names,
                                                           "config": {"model_type": "dit"}})).read()
        assert "a diffusion transformer (DiT" in text and "a UNet" not in text, kind
        assert "`pipeline_dit.py` in this repository" in text and "pipeline.guide" not in text, kind
        code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
        exec(compile(code.replace("num_inference_steps=50", "num_inference_steps=2"), "model card", "exec"), {})
        assert (tmp_path / "sample.png").is_file(), kind
        (tmp_path / "sample.png").unlink()
