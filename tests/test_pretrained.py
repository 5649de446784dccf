"""Fine-tuning a saved pipeline (diffusion_extras/training/pretrained.py): from a folder and from the
loopback Hub (safetensors and an older .bin), the UNet's weights and the EMA start from it, the
scheduler's settings are taken, data that does not fit is one line, the recipe applies where
unset, the card names the base, and a resume is exact without reading the base's weights again."""
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from helpers import (
    TINY_RECIPE,
    load_unet_weights,
    run_training,
    save_dit_pipeline_form,
    save_random_images,
    save_tiny_pipeline,
    tiny_run,
    tiny_unet,
)
from hub_server import HubServer
from processes import launch_training

from diffusion_extras.training import models, pretrained
from diffusion_extras.training.config import ConfigError

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def save_base(path, channels: int = 1) -> str:
    """save_tiny_pipeline with weights no fresh initialisation gives (a seed-0 init equals tiny_unet's)."""
    from diffusers import UNet2DModel
    folder = save_tiny_pipeline(path, channels=channels)
    unet = UNet2DModel.from_pretrained(folder, subfolder="unet")
    with torch.no_grad():
        for parameter in unet.parameters():
            parameter.add_(0.01)
    unet.save_pretrained(os.path.join(folder, "unet"))
    return folder


def test_a_run_starts_from_the_pipelines_weights_and_scheduler(tmp_path, capsys):
    base = save_base(tmp_path / "base")  # DDPMScheduler(num_train_timesteps=100), 8 px, 1 channel
    run = tiny_run(tmp_path, "--pretrained_model_name_or_path", base)
    expected = load_unet_weights(base)
    unet = run.accelerator.unwrap_model(run.learner.unet)
    assert all(torch.equal(value, expected[name]) for name, value in unet.state_dict().items())
    # the EMA starts there too
    assert all(torch.equal(a, b) for a, b in zip(run.extras.ema.shadow_params, unet.parameters()))
    assert run.config.ddpm_num_steps == 100 and run.objective.noise_scheduler.config.num_train_timesteps == 100
    # the recipe sets learning_rate and lr_warmup_steps (kept); the run length is the fine-tuning recipe's
    assert (run.plan.max_train_steps, run.plan.learning_rate, run.plan.lr_warmup_steps) == (600, 1e-3, 2)
    line = [li for li in capsys.readouterr().out.splitlines() if li.startswith("model: ")][0]
    assert f"pretrained UNet of {base}" in line
    assert (f"fine-tuning recipe for {models.count_parameters(unet):,} parameters (max_train_steps 600); "
            "yours kept: --learning_rate, --lr_warmup_steps; loss unweighted, as the base trained "
            "(no training config: DDPM's L_simple assumed)") in line
    assert run.config.snr_gamma == 0.0  # the base's objective, not the trainer's min-SNR default


def test_the_fine_tuning_recipe_fills_what_the_user_left_unset(tmp_path):
    base = save_base(tmp_path / "base")
    recipe = {k: v for k, v in TINY_RECIPE.items() if k not in ("learning_rate", "lr_warmup_steps", "resolution")}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    from diffusion_extras.training import build
    from diffusion_extras.training.config import parse_config
    run = build.setup(parse_config(["--config", str(path), "--output_dir", str(tmp_path / "run"),
                                    "--pretrained_model_name_or_path", base]))
    parameters = models.count_parameters(run.accelerator.unwrap_model(run.learner.unet))
    expected = pretrained.finetune_recipe(parameters)  # the tiny UNet's size, not the digits'
    assert expected["learning_rate"] > 2e-4 and expected["lr_warmup_steps"] < 50
    assert (run.plan.learning_rate, run.plan.lr_warmup_steps, run.plan.max_train_steps) == \
        (expected["learning_rate"], expected["lr_warmup_steps"], 600)
    assert run.config.resolution == 8  # the pipeline's sample_size


@pytest.mark.parametrize("parameters, learning_rate, warmup", [
    (1_112_801, 2e-4, 50),      # the digits recipe's UNet: the measured point (docs/BENCHMARKS.md)
    (35_746_307, 2e-5, 160),    # google/ddpm-cifar10-32, trained from scratch at 2e-4
    (113_673_219, 9.2e-6, 235),  # diffusers' train_unconditional.py default UNet, from scratch at 1e-4
])
def test_the_recipe_follows_the_bases_size(parameters, learning_rate, warmup):
    assert pretrained.finetune_recipe(parameters) == {
        "learning_rate": learning_rate, "lr_warmup_steps": warmup, "max_train_steps": 600}


def test_the_model_line_says_whether_the_loss_weighting_changes_the_bases_objective(tmp_path, capsys):
    base = save_base(tmp_path / "base")
    run = tiny_run(tmp_path, "--pretrained_model_name_or_path", base, "--snr_gamma", 5)
    assert run.config.snr_gamma == 5.0
    assert ("loss min-SNR-5, which changes the base's objective (unweighted; no training config: DDPM's "
            "L_simple assumed)") in capsys.readouterr().out
    (tmp_path / "base" / "training_config.yaml").write_text(yaml.safe_dump({"snr_gamma": 5.0}))  # this trainer's
    run = tiny_run(tmp_path, "--pretrained_model_name_or_path", base, output_dir=tmp_path / "b")
    assert run.config.snr_gamma == 5.0
    assert "loss min-SNR-5, as the base trained (its training_config.yaml)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--resolution", 16], "its UNet samples at 8 px and --resolution is 16: train at --resolution 8"),
    (["--class_conditional"], "its UNet has no class embedding and the data has 10 classes"),
])
def test_data_that_does_not_fit_is_one_line_naming_both(tmp_path, flags, message):
    base = save_base(tmp_path / "base")
    with pytest.raises(ConfigError, match=message):
        tiny_run(tmp_path, "--pretrained_model_name_or_path", base, *flags)


def test_grayscale_images_fine_tune_an_rgb_base_and_other_channel_mismatches_name_their_fix(tmp_path, capsys):
    rgb_base = save_base(tmp_path / "rgb", channels=3)
    run = tiny_run(tmp_path, "--pretrained_model_name_or_path", rgb_base)  # the digits: grayscale
    assert run.data.source.reference_sample(2).shape[1] == 3  # as grey RGB images (N, C, H, W)
    assert "data: the images are grayscale and the UNet has 3 channel(s): converting them to RGB" in \
        capsys.readouterr().out
    colour = save_random_images(tmp_path / "colour", 8, 8, 8)
    refusals = [
        (save_base(tmp_path / "gray"), ["--train_data_dir", colour],
         r"its UNet has 1 channel\(s\) \(grayscale\) and the images have 3 \(RGB\): converting them to grayscale "
         "would drop their colour: fine-tune on grayscale images, or choose an RGB base"),
        (save_base(tmp_path / "rgba", channels=4), ["--train_data_dir", colour],
         r"its UNet has 4 channel\(s\) \(RGBA\) and the images have 3 \(RGB\): add --keep_alpha"),
        (rgb_base, ["--train_data_dir", colour, "--keep_alpha"],
         r"its UNet has 3 channel\(s\) \(RGB\) and the images have 4 \(RGBA\): drop --keep_alpha"),
    ]
    for index, (base, flags, message) in enumerate(refusals):
        with pytest.raises(ConfigError, match=message):
            tiny_run(tmp_path, "--pretrained_model_name_or_path", base, *flags, output_dir=tmp_path / f"r{index}")
    with pytest.raises(ConfigError, match="not a DDPMPipeline or DiTPipeline folder or Hub id"):
        tiny_run(tmp_path, "--pretrained_model_name_or_path", str(tmp_path))


def test_a_home_relative_folder_is_a_folder_not_a_hub_id(tmp_path, monkeypatch):
    save_base(tmp_path / "base")
    monkeypatch.setenv("HOME", str(tmp_path))
    run = tiny_run(tmp_path, "--pretrained_model_name_or_path", "~/base")
    unet = run.accelerator.unwrap_model(run.learner.unet)
    expected = load_unet_weights(tmp_path / "base")
    assert all(torch.equal(value, expected[name]) for name, value in unet.state_dict().items())
    with pytest.raises(ConfigError, match=r"--pretrained_model_name_or_path ~/missing: DDPMPipeline folder "
                                          r".*/missing does not exist \(nor is it a Hub id"):
        tiny_run(tmp_path, "--pretrained_model_name_or_path", "~/missing", output_dir=tmp_path / "b")


def test_a_hub_id_offline_and_not_in_the_cache_names_hf_hub_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(ConfigError, match=r"--pretrained_model_name_or_path someone/ddpm-tiny: cannot download it: "
                                          r"HF_HUB_OFFLINE is set and someone/ddpm-tiny is not in the Hub cache"):
        tiny_run(tmp_path, "--pretrained_model_name_or_path", "someone/ddpm-tiny")


@pytest.mark.parametrize("sample_size, flags, message", [
    ([8, 8], ["--resolution", 16], "its UNet samples at 8 px and --resolution is 16: train at --resolution 8"),
    ([8, 16], ["--resolution", 16], "its UNet samples at 8x16 px and --resolution is 16: train at --resolution 8x16"),
])
def test_a_list_sample_size_is_checked_as_an_int_one(tmp_path, sample_size, flags, message):
    import json
    base = save_base(tmp_path / "base")
    config_path = os.path.join(base, "unet", "config.json")
    with open(config_path) as fh:
        unet_config = json.load(fh)
    with open(config_path, "w") as fh:
        json.dump({**unet_config, "sample_size": sample_size}, fh)
    recipe = {k: v for k, v in TINY_RECIPE.items() if k != "resolution"}
    with pytest.raises(ConfigError, match=message):
        tiny_run(tmp_path, "--pretrained_model_name_or_path", base, *flags, **recipe)


def test_this_trainers_class_conditional_export_fine_tunes(tmp_path):
    from diffusers import DDPMScheduler
    unet = tiny_unet(num_class_embeds=11)
    models.save_class_conditional(unet, DDPMScheduler(num_train_timesteps=100), [str(i) for i in range(10)],
                                  str(tmp_path / "conditional"))
    run = tiny_run(tmp_path, "--pretrained_model_name_or_path", tmp_path / "conditional", "--class_conditional")
    loaded = run.accelerator.unwrap_model(run.learner.unet)
    assert loaded.config.num_class_embeds == 11
    assert torch.equal(loaded.class_embedding.weight, unet.class_embedding.weight)
    with pytest.raises(ConfigError, match=r"class-conditional \(10 classes\): add --class_conditional"):
        tiny_run(tmp_path, "--pretrained_model_name_or_path", tmp_path / "conditional", output_dir=tmp_path / "b")


def test_fine_tuning_resumes_exactly_without_reading_the_base_weights(tiny_recipe, tmp_path):
    base = save_base(tmp_path / "base")
    recipe = tiny_recipe(checkpointing_steps=2)
    flags = ["--pretrained_model_name_or_path", base]
    run_training(recipe, tmp_path / "straight", *flags, "--max_train_steps", 4)
    run_training(recipe, tmp_path / "resumed", *flags, "--max_train_steps", 2)
    os.remove(os.path.join(base, "unet", "diffusion_pytorch_model.safetensors"))  # a resume must not need it
    result = run_training(recipe, tmp_path / "resumed", *flags, "--max_train_steps", 4, "--resume_from_checkpoint",
                          "latest")
    assert "resumed from" in result.stdout
    straight, resumed = (load_unet_weights(tmp_path / name) for name in ("straight", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_fine_tuning_from_the_hub_exports_and_pushes_with_the_base_named(tiny_recipe, tmp_path, weights):
    """A process of its own, pointed at the local Hub by HF_ENDPOINT (read when huggingface_hub loads)."""
    from diffusers import UNet2DModel
    base = save_base(tmp_path / "base")
    if weights == "bin":  # an older upload: unet/diffusion_pytorch_model.bin
        unet = UNet2DModel.from_pretrained(base, subfolder="unet")
        shutil.rmtree(os.path.join(base, "unet"))
        unet.save_pretrained(os.path.join(base, "unet"), safe_serialization=False)
    assert os.path.isfile(os.path.join(base, "unet", f"diffusion_pytorch_model.{weights}"))
    with HubServer() as server:
        server.add_repo("someone/ddpm-tiny", base)
        env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": tmp_path / "hf_home",
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        result = launch_training(tiny_recipe(), tmp_path / "tuned", "--pretrained_model_name_or_path",
                                 "someone/ddpm-tiny", "--max_train_steps", 2, "--push_to_hub", "--hub_token", "hf_test",
                                 env=env)
        card = server.repos["test-user/tuned"]["files"]["README.md"].decode()
    assert "pretrained UNet of someone/ddpm-tiny" in result.stdout
    assert yaml.safe_load(card.split("---")[1])["base_model"] == "someone/ddpm-tiny"
    assert "Fine-tuned from `someone/ddpm-tiny`." in card
    with open(tmp_path / "tuned" / "scheduler" / "scheduler_config.json") as fh:
        assert '"num_train_timesteps": 100' in fh.read()  # the base's schedule, exported


def test_a_fine_tuning_resume_reads_the_base_from_its_checkpoint_not_the_hub(tmp_path, monkeypatch, tiny_recipe):
    """The base's configs are recorded in the checkpoint: a resume asks the Hub nothing (offline it
    would work), and a repo changed since (its beta_end, clip_sample) changes nothing."""
    import json

    from hub_server import HubServer, serve_in_process
    base = save_base(tmp_path / "base")  # DDPMScheduler(num_train_timesteps=100): beta_end 0.02
    recipe, out = tiny_recipe(checkpointing_steps=2), tmp_path / "tuned"
    with HubServer() as server:
        server.add_repo("someone/ddpm-tiny", base)
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        run_training(recipe, out, "--pretrained_model_name_or_path", "someone/ddpm-tiny", "--max_train_steps", 2)
        changed = {**json.loads(server.repos["someone/ddpm-tiny"]["files"]["scheduler/scheduler_config.json"]),
                   "beta_end": 0.03, "clip_sample": False}
        server.repos["someone/ddpm-tiny"]["files"]["scheduler/scheduler_config.json"] = json.dumps(changed).encode()
        serve_in_process(monkeypatch, server, tmp_path / "empty_hub_cache")  # nothing cached either
        asked_before = len(server.requests)
        run_training(recipe, out, "--pretrained_model_name_or_path", "someone/ddpm-tiny", "--max_train_steps", 4,
                     "--resume_from_checkpoint", "latest")
        assert server.requests[asked_before:] == []
    with open(out / "scheduler" / "scheduler_config.json") as fh:
        exported = json.load(fh)
    assert (exported["beta_end"], exported["clip_sample"]) == (0.02, True)
    assert exported["num_train_timesteps"] == 100


def test_a_hub_pipeline_laid_out_at_its_root_fine_tunes(tmp_path, monkeypatch):
    """google/ddpm-cifar10-32 keeps its UNet (config.json, weights) and scheduler_config.json at the
    repo's root, which diffusers' pipelines load when unet/ and scheduler/ are missing: served by
    the loopback Hub in that form (its stored configs, narrower), it fine-tunes from its weights."""
    from diffusers import UNet2DModel
    from helpers import save_google_ddpm_form
    from hub_server import serve_in_process

    from diffusion_extras.training import build
    from diffusion_extras.training.config import parse_config
    base = save_google_ddpm_form(tmp_path / "base", "google--ddpm-cifar10-32")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({k: v for k, v in TINY_RECIPE.items() if k not in ("model", "resolution")}))
    with HubServer() as server:
        server.add_repo("google/ddpm-cifar10-32", base)
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        run = build.setup(parse_config(["--config", str(recipe), "--output_dir", str(tmp_path / "run"),
                                        "--pretrained_model_name_or_path", "google/ddpm-cifar10-32"]))
    expected = UNet2DModel.from_pretrained(base).state_dict()
    unet = run.accelerator.unwrap_model(run.learner.unet)
    assert all(torch.equal(value, expected[name]) for name, value in unet.state_dict().items())
    assert (run.config.resolution, run.config.variance_type) == (32, "fixed_large")


# ----------------------------------------------------------------------------- a DiT pipeline as the Hub stores it
def labelled_images(folder, classes=("cat", "dog", "fox")) -> str:
    """Four random 32 px images of each class in an image folder (class = subfolder)."""
    for index, name in enumerate(classes):
        save_random_images(os.path.join(folder, name), 4, 32, 32, seed=index)
    return str(folder)


def test_a_dit_pipeline_brings_its_backbone_schedule_variance_and_vae(tmp_path):
    """facebook/DiT-XL-2-256's form: a Transformer2DModel config (diffusers 0.12), a DDIMScheduler that
    names no variance though the DiT learns one (8 outputs for 4 channels), a VAE of 0.12's form."""
    from diffusion_extras.training.config import parse_config
    base = save_dit_pipeline_form(tmp_path / "base")
    config, loaded = pretrained.resolve(parse_config(["--pretrained_model_name_or_path", base, "--class_conditional",
                                                      "--output_dir", str(tmp_path / "run")]))
    assert (loaded.model_type, loaded.subfolder) == ("dit", "transformer")
    assert "cross_attention_dim" not in loaded.model_config  # the older form's fields of other transformers
    assert (config.model_type, config.variance_type, config.objective) == ("dit", "learned_range", "ddpm")
    assert (config.ddpm_num_steps, config.ddpm_beta_schedule, config.prediction_type) == (1000, "linear", "epsilon")
    assert config.resolution == 256 and config.pretrained_vae_model_name_or_path == base  # 32x32 latents x 8
    with pytest.raises(ConfigError, match=r"--model_type unet: --pretrained_model_name_or_path .* is a DiT; a "
                                          "fine-tune keeps its base's backbone: drop --model_type"):
        pretrained.resolve(parse_config(["--pretrained_model_name_or_path", base, "--model_type", "unet"]))
    with pytest.raises(ConfigError, match=r"its DiT outputs 8 channels for 4-channel samples \(a learned variance\) "
                                          "and --variance_type is fixed_small: leave --variance_type out"):
        fixed, loaded = pretrained.resolve(parse_config(["--pretrained_model_name_or_path", base, "--variance_type",
                                                         "fixed_small"]))
        from diffusion_extras.training import autoencoder
        loaded.choice(fixed, 3, None, autoencoder.load_latent_space(fixed))


def test_a_dit_pipeline_on_the_hub_is_found_by_its_model_index(tmp_path, monkeypatch):
    """A Hub id: its model_index.json names the transformer component, whose config and weights load
    from transformer/ (the loopback Hub, in this process)."""
    from hub_server import serve_in_process

    from diffusion_extras.training.config import parse_config
    base = save_dit_pipeline_form(tmp_path / "base")
    with HubServer() as server:
        server.add_repo("facebook/DiT-XL-2-256", base)
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        config, loaded = pretrained.resolve(parse_config(["--pretrained_model_name_or_path", "facebook/DiT-XL-2-256",
                                                          "--output_dir", str(tmp_path / "run")]))
        model = loaded.load_model(None, with_weights=True)
    assert (config.model_type, loaded.subfolder, model.config.num_embeds_ada_norm) == ("dit", "transformer", 1)
    assert config.pretrained_vae_model_name_or_path == "facebook/DiT-XL-2-256"  # its own vae/


@pytest.mark.parametrize("classes", [3, 1000, None])
def test_a_dit_bases_label_table_is_fitted_to_the_runs_classes(tmp_path, classes):
    """Every weight is the base's but the blocks' label tables: kept for as many classes as the base's,
    else each class row (and the "no class" row, last) a copy of the base's "no class" row."""
    from diffusers import DiTTransformer2DModel
    base = save_dit_pipeline_form(tmp_path / "base")
    names = None if classes is None else [str(index) for index in range(classes)]
    model = pretrained.load(base).load_model(names, with_weights=True)
    weights = DiTTransformer2DModel.from_pretrained(base, subfolder="transformer").state_dict()
    tables = [key for key in weights if key.endswith("class_embedder.embedding_table.weight")]
    assert len(tables) == 2 and model.config.num_embeds_ada_norm == (classes or 1)
    for key, value in model.state_dict().items():
        if key not in tables:
            assert torch.equal(value, weights[key]), key
        elif classes == 1000:
            assert torch.equal(value, weights[key])
        else:
            assert torch.equal(value, weights[key][-1:].expand((classes or 1) + 1, -1)), key
    assert all(module.dropout_prob == 0 for module in model.modules() if hasattr(module, "dropout_prob")
               and hasattr(module, "embedding_table"))  # the trainer drops labels, by its seed rule


def test_a_dit_pipeline_fine_tunes_onto_new_classes_and_resumes_bit_for_bit_in_a_new_process(tiny_recipe, tmp_path):
    """Three classes of the user's on a DiT-XL-2-256-form base: the model line says what was refitted;
    the run stopped at checkpoint-2 resumes in another process (another PYTHONHASHSEED, the base's
    weights gone) to the straight run's weights, bit for bit; the export samples with guidance and
    DDIM swapped in."""
    from diffusers import DDIMScheduler, DiffusionPipeline
    base = save_dit_pipeline_form(tmp_path / "base")
    data = labelled_images(tmp_path / "data")
    recipe = tiny_recipe(model=None, resolution=None, checkpointing_steps=2, train_batch_size=4)
    flags = ["--train_data_dir", data, "--pretrained_model_name_or_path", base, "--class_conditional"]
    straight = run_training(recipe, tmp_path / "straight", *flags, "--max_train_steps", 4)
    line = next(li for li in straight.stdout.splitlines() if li.startswith("model: "))
    assert (f"pretrained DiT of {base}, 3 classes, its label table refitted from 1000 classes to 3 (each class "
            "starts as its \"no class\" row") in line
    assert "latents: normalised by the VAE config's scaling_factor 0.18215 (diffusers' default" in straight.stdout
    run_training(recipe, tmp_path / "resumed", *flags, "--max_train_steps", 2)
    os.remove(os.path.join(base, "transformer", "diffusion_pytorch_model.safetensors"))  # a resume must not need it
    result = launch_training(recipe, tmp_path / "resumed", *flags, "--max_train_steps", 4, "--resume_from_checkpoint",
                             "latest", env={"PYTHONHASHSEED": "7"})
    assert "resumed from" in result.stdout
    a, b = (load_unet_weights(tmp_path / name) for name in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert a["transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight"].shape[0] == 4
    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "straight", trust_remote_code=True)
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
    images = pipeline(class_labels=[0, 2], guidance_scale=2.0, num_inference_steps=2, output_type="np",
                      generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (2, 256, 256, 3) and np.isfinite(images).all()


def test_a_checkpoint_of_an_earlier_release_resumes_with_its_recorded_unet(tmp_path, monkeypatch):
    """Checkpoints written before DiT bases recorded the base's UNet under "unet" and no model_type:
    a resume reads them as a UNet's, from the record alone (the base folder gone)."""
    from diffusion_extras.training import checkpointing
    from diffusion_extras.training.config import parse_config
    unet = {**TINY_RECIPE["model"], "sample_size": 8}
    scheduler = {"_class_name": "DDPMScheduler", "num_train_timesteps": 100, "beta_schedule": "linear"}
    name = str(tmp_path / "gone")
    earlier = {"pretrained_model_name_or_path": name, "pretrained": {
        "unet": unet, "scheduler": scheduler, "snr_gamma": 0.0, "vae_factor": None, "conditioning": None}}
    monkeypatch.setattr(checkpointing, "recorded_config", lambda output_dir, resume_from: earlier)
    config, base = pretrained.resolve(parse_config(["--pretrained_model_name_or_path", name, "--resume_from_checkpoint",
                                                    "latest", "--output_dir", str(tmp_path / "run")]))
    assert (base.model_type, base.model_config, config.model_type, config.ddpm_num_steps) == ("unet", unet, "unet", 100)
    assert list(base.load_model(None, with_weights=False).config.block_out_channels) == [8, 16]
