"""What users bring: every config of tests/hub_configs (as the Hub repos store them: VAEs of Stable
Diffusion 1.x/2.x, sd-vae-ft-mse, SDXL, SD3, FLUX.1, LDM's VQModel; google/ddpm-* pipelines laid
out at their root; facebook/DiT-XL-2-256's transformer in diffusers 0.12's Transformer2DModel form)
built into weights of reduced widths and taken through the command lines it serves: latent training
(a VAE) or fine-tuning (a pipeline), a resume in another interpreter with another PYTHONHASHSEED
that pushes to the loopback Hub, `sample`, `evaluate`, and loading the export without the package.
The runs are made once for the module (one xdist worker)."""
import json
import os
import subprocess
import sys

import pytest
from helpers import (
    TINY_RECIPE,
    run_cli,
    run_training,
    save_dit_pipeline_form,
    save_from_hub_config,
    save_google_ddpm_form,
    save_random_images,
    tiny_hub_config,
    write_tiny_recipe,
)
from hub_server import HubServer
from package_blocker import BLOCK_THE_PACKAGE
from PIL import Image
from processes import run_command

pytestmark = pytest.mark.xdist_group("hub_configs")

TOKEN = "hf_corpus_test"
# name: (the corpus config, the subfolder of the user's download it sits in, the run's pixel resolution)
VAES = {
    "sd-1.5": ("runwayml--stable-diffusion-v1-5/vae/config.json", "vae", 16),
    "sd-2.1": ("stabilityai--stable-diffusion-2-1/vae/config.json", "vae", 16),
    "sd-vae-ft-mse": ("stabilityai--sd-vae-ft-mse/config.json", None, 16),
    "sdxl": ("stabilityai--stable-diffusion-xl-base-1.0/vae/config.json", "vae", 16),
    "sd3": ("stabilityai--stable-diffusion-3-medium-diffusers/vae/config.json", "vae", 16),
    "flux.1": ("black-forest-labs--FLUX.1-dev/vae/config.json", "vae", 16),
    "ldm-celebahq": ("CompVis--ldm-celebahq-256/vqvae/config.json", "vqvae", 16),
}
PIPELINES = {  # google/ddpm-*: fine-tuned at their UNet's sample_size
    "ddpm-cifar10-32": ("google--ddpm-cifar10-32", 32),
    "ddpm-cat-256": ("google--ddpm-cat-256", 256),
}
DIT = "dit-xl-2-256"  # facebook/DiT-XL-2-256 (save_dit_pipeline_form), fine-tuned unconditionally at 256 px
NAMES = [*VAES, *PIPELINES, DIT]


def latent_model(path: str) -> dict:
    channels = tiny_hub_config(path)["latent_channels"]
    return {**TINY_RECIPE["model"], "in_channels": channels, "out_channels": channels}


@pytest.fixture(scope="module")
def corpus_runs(tmp_path_factory):
    """Each corpus config's run: its user folder (a VAE or a pipeline built from it), trained 1
    step with a checkpoint in this process. {name: (output folder, its command line's flags)}."""
    runs = {}
    for name, (path, subfolder, resolution) in VAES.items():
        folder = tmp_path_factory.mktemp(name)
        download = folder / "download"
        save_from_hub_config(download / subfolder if subfolder else download, path)
        recipe = write_tiny_recipe(folder, model=latent_model(path), resolution=resolution, checkpointing_steps=1,
                                   train_batch_size=4, max_train_samples=16)
        flags = ["--config", recipe, "--pretrained_vae_model_name_or_path", str(download)]
        runs[name] = (folder / "run", flags)
    for name, (repo, resolution) in PIPELINES.items():
        folder = tmp_path_factory.mktemp(name)
        recipe = write_tiny_recipe(folder, checkpointing_steps=1, train_batch_size=2, max_train_samples=8,
                                   eval_batch_size=2)
        flags = ["--config", recipe, "--resolution", str(resolution), "--pretrained_model_name_or_path",
                 save_google_ddpm_form(folder / "download", repo)]
        runs[name] = (folder / "run", flags)
    folder = tmp_path_factory.mktemp(DIT)
    recipe = write_tiny_recipe(folder, model=None, resolution=None, checkpointing_steps=1, train_batch_size=2,
                               max_train_samples=8, eval_batch_size=2)
    runs[DIT] = (folder / "run", ["--config", recipe, "--pretrained_model_name_or_path",
                                  save_dit_pipeline_form(folder / "download")])
    for run, flags in runs.values():
        result = run_training(flags[1], run, *flags[2:], "--max_train_steps", 1)
        (run.parent / "first.log").write_text(result.stdout)
    return runs


RESUME_ALL = """
import json, sys
from diffusion_extras.training.main import main
codes = {name: main(argv) for name, argv in json.loads(sys.argv[1]).items()}
print("exit codes: " + json.dumps(codes))
"""


@pytest.fixture(scope="module")
def resumed(corpus_runs, tmp_path_factory):
    """Every run resumed to step 2 in one new interpreter (PYTHONHASHSEED 4242; the training
    command's main, run for each), each pushing its export to the loopback Hub at the end.
    (exit codes, its output, the Hub's repos)."""
    folder = tmp_path_factory.mktemp("resume")
    script = folder / "resume_all.py"
    script.write_text(RESUME_ALL)
    argvs = {name: [*map(str, flags), "--output_dir", str(run), "--max_train_steps", "2",
                    "--resume_from_checkpoint", "latest", "--push_to_hub", "--hub_token", TOKEN,
                    "--hub_model_id", f"test-user/{name}"]
             for name, (run, flags) in corpus_runs.items()}
    with HubServer(token=TOKEN) as server:
        env = {"PYTHONHASHSEED": "4242", "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0",
               "HF_HOME": folder / "hf_home", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        result = run_command([script, json.dumps(argvs)], env=env, timeout=900)
    codes = json.loads(result.stdout.split("exit codes: ")[-1].strip().splitlines()[0])
    return codes, result.stdout, server.repos


def first_log(corpus_runs, name: str) -> str:
    return (corpus_runs[name][0].parent / "first.log").read_text()


def test_every_vae_trains_normalised_as_its_config_says(corpus_runs):
    """The configs without a scale (SD 1.x, 2.x, sd-vae-ft-mse of 2022; LDM's VQModel) are normalised
    by measured statistics, SDXL's by its 0.13025, SD3's and FLUX.1's by their shift and scale, on
    16-channel latents; the SDXL export keeps force_upcast."""
    for name in ("sd-1.5", "sd-2.1", "sd-vae-ft-mse", "ldm-celebahq"):
        assert "latents: normalised by their per-channel mean and std, measured on the training latents" \
            in first_log(corpus_runs, name), name
    assert "latents: normalised by the VAE config's scaling_factor 0.13025\n" in first_log(corpus_runs, "sdxl")
    assert "latents: normalised by the VAE config's scaling_factor 1.5305 and shift_factor 0.0609" \
        in first_log(corpus_runs, "sd3")
    assert "latents: normalised by the VAE config's scaling_factor 0.3611 and shift_factor 0.1159" \
        in first_log(corpus_runs, "flux.1")
    for name in ("sd3", "flux.1"):
        assert "16 channel(s) (latents of the VAE" in first_log(corpus_runs, name)
    sdxl = json.loads((corpus_runs["sdxl"][0] / "vae" / "config.json").read_text())
    assert sdxl["force_upcast"] is True and sdxl["scaling_factor"] == 0.13025
    vq = json.loads((corpus_runs["ldm-celebahq"][0] / "model_index.json").read_text())
    assert vq["vae"] == ["diffusers", "VQModel"]


def test_the_google_pipelines_fine_tune_from_their_root_layout(corpus_runs):
    """google/ddpm-* keep the UNet's config.json and weights and scheduler_config.json at the repo's
    root (no unet/, scheduler/): the fine-tune starts from them, with their scheduler's settings."""
    for name, (_, resolution) in PIPELINES.items():
        download = corpus_runs[name][1][-1]
        assert not os.path.isdir(os.path.join(download, "unet"))
        assert f"model: pretrained UNet of {download}" in first_log(corpus_runs, name)
        stored = json.loads(open(os.path.join(download, "scheduler_config.json")).read())
        exported = json.loads((corpus_runs[name][0] / "scheduler" / "scheduler_config.json").read_text())
        assert (exported["variance_type"], exported["clip_sample"]) == (stored["variance_type"], True)
        assert json.loads((corpus_runs[name][0] / "unet" / "config.json").read_text())["sample_size"] == resolution


def test_every_run_resumes_in_another_interpreter_and_pushes_its_export(corpus_runs, resumed):
    codes, output, repos = resumed
    assert codes == dict.fromkeys(NAMES, 0)
    for name, (run, _) in corpus_runs.items():
        assert f"resumed from {run / 'checkpoint-1'} at optimizer step 1" in output, name
        files = repos[f"test-user/{name}"]["files"]
        model = "transformer" if name == DIT else "unet"
        expected = {"model_index.json", f"{model}/config.json", "scheduler/scheduler_config.json", "README.md"}
        assert expected <= set(files), name
        assert name not in VAES or {"vae/config.json", "pipeline_latent.py"} <= set(files), name
    card = repos["test-user/ldm-celebahq"]["files"]["README.md"].decode()
    assert "trained on the latents of the VQModel `" in card


@pytest.mark.parametrize("name", NAMES)
def test_sample_and_evaluate_every_export(name, corpus_runs, resumed, tmp_path):
    run = corpus_runs[name][0]
    side = VAES[name][2] if name in VAES else PIPELINES[name][1] if name in PIPELINES else 256
    result = run_cli(["-m", "diffusion_extras.sample", run, "--num_images", 2, "--num_inference_steps", 2,
                      "--batch_size", 2, "--output", tmp_path / "samples", "--device", "cpu"])
    with Image.open(tmp_path / "samples" / "000001.png") as image:
        assert image.size == (side, side) and image.mode == "RGB", result.stdout
    reference = save_random_images(tmp_path / "reference", 4, side, side)
    run_cli(["-m", "diffusion_extras.evaluate", run, "--reference", reference, "--num_samples", 2,
             "--feature_extractor", "tiny", "--num_inference_steps", 2, "--batch_size", 2,
             "--cache_dir", tmp_path / "cache", "--output", tmp_path / "metrics.json", "--device", "cpu"])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_samples"] == 2 and metrics["fid"] > 0


LOAD_ALL = BLOCK_THE_PACKAGE + """
import json, sys
import numpy as np, torch
from diffusers import DiffusionPipeline
for name, folder in json.loads(sys.argv[1]).items():
    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    images = pipe(batch_size=1, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert np.isfinite(images).all(), name
    print(name, type(pipe).__name__, type(getattr(pipe, "vae", None)).__name__, np.asarray(images).shape)
"""


def test_every_export_loads_and_samples_without_the_package(corpus_runs, resumed, tmp_path):
    script = tmp_path / "load_all.py"
    script.write_text(LOAD_ALL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    folders = {name: str(run) for name, (run, _) in corpus_runs.items()}
    result = subprocess.run([sys.executable, str(script), json.dumps(folders)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    for name in VAES:
        vae = "VQModel" if name == "ldm-celebahq" else "AutoencoderKL"
        assert lines[name] == f"LatentDiffusionPipeline {vae} (1, 16, 16, 3)", name
    assert lines["ddpm-cifar10-32"] == "DDPMPipeline NoneType (1, 32, 32, 3)"
    assert lines["ddpm-cat-256"] == "DDPMPipeline NoneType (1, 256, 256, 3)"
    assert lines[DIT] == "DiTClassPipeline AutoencoderKL (1, 256, 256, 3)"


def test_the_dit_pipeline_fine_tunes_as_its_base_trained(corpus_runs):
    """facebook/DiT-XL-2-256's form fine-tuned without labels: a DiT given its "no class" row, its
    learned variance, its DDIM scheduler's betas and its VAE's default scale (as DiTPipeline decodes)."""
    log = first_log(corpus_runs, DIT)
    assert "unconditional: its label table of 1000 classes cut to its \"no class\" row" in log
    assert "latents: normalised by the VAE config's scaling_factor 0.18215 (diffusers' default" in log
    run = corpus_runs[DIT][0]
    exported = json.loads((run / "scheduler" / "scheduler_config.json").read_text())
    assert (exported["variance_type"], exported["beta_schedule"], exported["clip_sample"]) == (
        "learned_range", "linear", False)
    transformer = json.loads((run / "transformer" / "config.json").read_text())
    assert (transformer["num_embeds_ada_norm"], transformer["out_channels"]) == (1, 8)
