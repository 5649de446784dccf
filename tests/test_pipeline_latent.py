"""The latent pipeline (evaluation/pipeline_latent.py) a latent run exports: vae/, unet/, scheduler/
and its source files; loaded without the package (trust_remote_code), it decodes images,
unconditional and class-conditional, with any scheduler, and output_type="latent" gives latents."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import LATENT_MODEL, run_cli, run_training, save_tiny_vae
from package_blocker import BLOCK_THE_PACKAGE
from PIL import Image

# Every test here reads `latent_runs` (module-scoped): on one xdist worker (--dist loadgroup) they are made once.
pytestmark = pytest.mark.xdist_group("test_pipeline_latent.latent_runs")


# A process that cannot import the package, as a user without it installed.
BLOCKED_LOAD = BLOCK_THE_PACKAGE + """
import sys
import numpy as np, torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler
for folder, labels in ((sys.argv[1], None), (sys.argv[2], ["3", "7"])):
    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    call = dict(batch_size=2) if labels is None else dict(class_labels=pipe.get_label_ids(labels))
    latents = pipe(**call, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                   output_type="latent").images
    images = pipe(**call, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="np").images
    pil = pipe(**call, num_inference_steps=3, generator=torch.Generator().manual_seed(0)).images
    # the decoding, by hand from the VAE config's scaling_factor (the tiny VAE has no shift)
    with torch.no_grad():
        decoded = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    expected = (decoded / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    assert tuple(latents.shape) == (2, 2, 4, 4) and np.asarray(images).shape == (2, 8, 8, 3), latents.shape
    assert np.abs(np.asarray(images) - expected).max() < 1e-5 and pil[0].size == (8, 8) and pil[0].mode == "RGB"
    print(type(pipe).__name__, type(pipe.vae).__name__, "conditional" if labels else "unconditional")
"""


def latent_run(folder, *flags):
    from helpers import run_training, write_tiny_recipe
    recipe = write_tiny_recipe(folder, model=LATENT_MODEL, save_images_steps=2, eval_batch_size=4)
    run_training(recipe, folder / "run", "--max_train_steps", 2, "--pretrained_vae_model_name_or_path",
                 save_tiny_vae(folder / "vae"), *flags)
    return folder / "run"


@pytest.fixture(scope="module")
def latent_runs(tmp_path_factory):
    """Two 2-step latent runs on the digits (tiny recipe, tiny RGB VAE): unconditional and class-conditional."""
    return (latent_run(tmp_path_factory.mktemp("unconditional")),
            latent_run(tmp_path_factory.mktemp("conditional"), "--class_conditional"))


def test_the_export_holds_the_vae_and_the_pipeline_files_and_the_grid_is_decoded(latent_runs):
    for run in latent_runs:
        index = json.loads((run / "model_index.json").read_text())
        assert index["_class_name"] == ["pipeline_latent", "LatentDiffusionPipeline"]
        assert index["vae"] == ["diffusers", "AutoencoderKL"]
        for name in ("vae/config.json", "unet/config.json", "scheduler/scheduler_config.json", "pipeline_latent.py",
                     "pipeline_class_conditional.py"):
            assert (run / name).is_file(), name
        assert json.loads((run / "unet" / "config.json").read_text())["sample_size"] == 4
        # latents are not clipped to the pixels' [-1, 1] while sampling (in training and from the export)
        assert json.loads((run / "scheduler" / "scheduler_config.json").read_text())["clip_sample"] is False
    # 4 decoded 8 px RGB images, 2 a row (a latent grid would be 4 px images of 2 channels)
    grid = Image.open(latent_runs[0] / "samples" / "step_000002.png")
    assert grid.size == (2 + 2 * 10, 2 + 2 * 10) and grid.mode == "RGB"


def test_loads_and_decodes_without_the_package_with_trust_remote_code(latent_runs, tmp_path):
    script = tmp_path / "load.py"
    script.write_text(BLOCKED_LOAD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, str(script), *map(str, latent_runs)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["LatentDiffusionPipeline AutoencoderKL unconditional",
                                             "LatentDiffusionPipeline AutoencoderKL conditional"]


def test_the_package_class_loads_the_folder_and_refuses_labels_for_an_unconditional_unet(latent_runs):
    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline
    pipe = LatentDiffusionPipeline.from_pretrained(latent_runs[0])
    assert pipe(batch_size=1, num_inference_steps=1).images[0].size == (8, 8)
    with pytest.raises(ValueError, match="this UNet is unconditional: give batch_size, not class_labels"):
        pipe(class_labels=[1], num_inference_steps=1)
    conditional = LatentDiffusionPipeline.from_pretrained(latent_runs[1])
    with pytest.raises(ValueError, match="a class-conditional UNet needs class_labels"):
        conditional(batch_size=2, num_inference_steps=1)


def test_the_sample_command_decodes_a_latent_export(latent_runs, tmp_path):
    for run, flags in zip(latent_runs, ((), ("--class_labels", "3,7"))):
        out = tmp_path / run.parent.name
        run_cli(["-m", "diffusion_extras.sample", run, "--num_images", 2, "--num_inference_steps", 2,
                 "--output", out, *flags])
        with Image.open(out / "000001.png") as image:
            assert image.size == (8, 8) and image.mode == "RGB"  # decoded: 8 px RGB, not 4 px latents


def test_the_model_card_of_a_latent_export_shows_calls_that_run_as_written(latent_runs, tmp_path, monkeypatch):
    """Written for each export as the Hub push writes it; its usage block runs against the folder
    (its repo id here) with trust_remote_code, and names the VAE."""
    from diffusion_extras.hub.push import write_model_card
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    for run, class_names in zip(latent_runs, (None, [str(k) for k in range(10)])):
        text = open(write_model_card(str(run), {"repo_id": str(run), "vae": "digits-vae",
                                                "class_names": class_names})).read()
        assert "latent-diffusion" in text and "the AutoencoderKL `digits-vae`, saved in `vae/`" in text
        code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
        assert f'DiffusionPipeline.from_pretrained("{run}", trust_remote_code=True)' in code
        namespace = {}
        monkeypatch.chdir(tmp_path)
        exec(compile(code, "model card", "exec"), namespace)
        with Image.open(tmp_path / "sample.png") as image:
            assert image.size == (8, 8)
        assert tuple(namespace["latents"].shape) == (2, 2, 4, 4)


def test_the_evaluate_command_scores_decoded_images_against_pixel_references(latent_runs, tmp_path):
    from helpers import save_random_images
    reference = save_random_images(tmp_path / "reference", 6, 8, 8)
    run_cli(["-m", "diffusion_extras.evaluate", latent_runs[0], "--reference", reference,
             "--num_samples", 4, "--feature_extractor", "tiny", "--num_inference_steps", 2,
             "--batch_size", 4, "--cache_dir", tmp_path / "cache", "--output", tmp_path / "m.json",
             "--device", "cpu"])
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["num_samples"] == 4 and metrics["reference_images"] == 6 and metrics["fid"] > 0
    from diffusion_extras.cli.common import load_pipeline, pipeline_resolution
    assert pipeline_resolution(load_pipeline(str(latent_runs[0]))) == 8  # references resized to the decoded side
    refused = run_cli(["-m", "diffusion_extras.evaluate", latent_runs[0], "--reference", reference,
                       "--eval_metrics", "nll", "--device", "cpu"], check=False)
    assert refused.returncode == 2 and "nll scores pixel pipelines" in refused.stderr


def test_fine_tuning_a_latent_export_takes_its_vae_and_exports_a_latent_pipeline(latent_runs, tiny_recipe, tmp_path):
    base = latent_runs[0]
    result = run_training(tiny_recipe(), tmp_path / "tuned", "--pretrained_model_name_or_path", base,
                          "--max_train_steps", 1)
    assert f"model: pretrained UNet of {base}: 2 channel(s) (latents of the VAE {base} (vae/) (4x4 from 8 px" \
        in result.stdout
    index = json.loads((tmp_path / "tuned" / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_latent", "LatentDiffusionPipeline"]
    older = shutil.copytree(base, tmp_path / "older")  # exported when latent runs still clipped x0 to [-1, 1]
    scheduler = older / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "clip_sample": True}))
    run_training(tiny_recipe(), tmp_path / "from-older", "--pretrained_model_name_or_path", older, "--max_train_steps",
                 1)
    assert json.loads((tmp_path / "from-older" / "scheduler" / "scheduler_config.json").read_text())["clip_sample"] \
        is False
    refused = run_training(tiny_recipe(), tmp_path / "pixels", "--pretrained_model_name_or_path", base,
                           "--pretrained_vae_model_name_or_path", base / "vae", "--resolution", 16, "--max_train_steps",
                           1, check=False)
    assert refused.returncode == 2
    assert "its UNet takes 2-channel latents of 4 px and the VAE makes 2-channel latents of 8 px" in refused.stderr
    from helpers import save_tiny_pipeline
    pixel = save_tiny_pipeline(tmp_path / "pixel")
    refused = run_training(tiny_recipe(), tmp_path / "mixed", "--pretrained_model_name_or_path", pixel,
                           "--pretrained_vae_model_name_or_path", base, "--max_train_steps", 1, check=False)
    assert refused.returncode == 2 and "its UNet was trained on pixels: drop --pretrained_vae" in refused.stderr


def test_the_hub_push_uploads_the_vae_and_both_pipeline_files(latent_runs):
    """HubPusher.pipeline_files (what push uploads) of a latent export; called on a stand-in for the
    pusher, whose constructor creates the Hub repository."""
    from types import SimpleNamespace

    from diffusion_extras.hub.push import HubPusher
    files = HubPusher.pipeline_files(SimpleNamespace(folder=str(latent_runs[1])))
    assert {"vae/config.json", "vae/diffusion_pytorch_model.safetensors", "pipeline_latent.py",
            "pipeline_class_conditional.py", "model_index.json", "unet/config.json"} <= set(files)
    assert not [name for name in files if name.startswith(("checkpoint", "logs/", "samples/"))]


def ldm_loop(pipe, shape, seed: int, steps: int, eta: float):
    """The UNet's latents as diffusers' LDMPipeline draws and denoises them (its __call__'s loop:
    randn_tensor, init_noise_sigma, scheduler.step with eta), here with its generator."""
    from diffusers.utils.torch_utils import randn_tensor
    generator = torch.Generator().manual_seed(seed)
    latents = randn_tensor(shape, generator=generator) * pipe.scheduler.init_noise_sigma
    pipe.scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in pipe.scheduler.timesteps:
            noise = pipe.unet(pipe.scheduler.scale_model_input(latents, t), t).sample
            latents = pipe.scheduler.step(noise, t, latents, eta=eta, generator=generator).prev_sample
    return latents


def test_eta_latents_and_the_generators_follow_diffusers_conventions(latent_runs):
    """eta reaches DDIM's step as in LDMPipeline (its loop's latents, to float rounding); `latents`
    replaces the drawn noise; a list of generators of another length than the batch is refused as
    randn_tensor refuses it; vae_scale_factor is the VAE's; autoguidance=True with no guide raises."""
    from diffusers import DDIMScheduler

    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline
    pipe = LatentDiffusionPipeline.from_pretrained(latent_runs[0])
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    assert pipe.vae_scale_factor == 2
    call = dict(batch_size=2, num_inference_steps=4, output_type="latent")
    ours = {eta: pipe(**call, eta=eta, generator=torch.Generator().manual_seed(3)).images for eta in (0.0, 1.0)}
    for eta, latents in ours.items():
        torch.testing.assert_close(latents, ldm_loop(pipe, (2, 2, 4, 4), 3, 4, eta), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ours[0.0], ours[1.0])
    noise = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pipe(**call, latents=noise).images, ours[0.0])
    with pytest.raises(ValueError, match=r"Unexpected latents shape, got \(1, 2, 4, 4\), expected \(2, 2, 4, 4\)"):
        pipe(**call, latents=noise[:1])
    with pytest.raises(ValueError, match="list of generators of length 3, but requested an effective batch size of 2"):
        pipe(**call, generator=[torch.Generator().manual_seed(k) for k in range(3)])
    assert pipe(**call, generator=[torch.Generator().manual_seed(k) for k in range(2)]).images.shape == (2, 2, 4, 4)
    with pytest.raises(ValueError, match="autoguidance=True needs a guide"):
        pipe(**call, autoguidance=True)


def test_a_force_upcast_vae_decodes_in_fp32_and_keeps_the_users_dtype(latent_runs):
    """As SDXL's pipeline: a bf16 VAE whose config says force_upcast decodes in fp32 (the fp32 decode
    of its bf16 weights, not a bf16 decode) and is given back in bf16; without the flag, in bf16."""
    import copy

    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline, decode_latents
    pipe = LatentDiffusionPipeline.from_pretrained(latent_runs[0])
    latents = pipe(batch_size=2, num_inference_steps=2, output_type="latent",
                   generator=torch.Generator().manual_seed(0)).images
    vae = pipe.vae.to(torch.bfloat16)
    reference = decode_latents(copy.deepcopy(vae).float(), latents)
    vae.register_to_config(force_upcast=True)
    decoded = decode_latents(vae, latents)
    assert vae.dtype == torch.bfloat16 and decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, reference)
    vae.register_to_config(force_upcast=False)
    assert (decode_latents(vae, latents) - reference).abs().max() > 1e-4  # a bf16 decode rounds
    assert pipe(batch_size=1, num_inference_steps=2, output_type="np").images.shape == (1, 8, 8, 3)


def test_from_pretrained_takes_revision_token_and_cache_dir_to_the_download(latent_runs, tmp_path, monkeypatch):
    """The package class loading a Hub id (the loopback Hub, which answers only with the token): its
    files come from the revision asked for, with the token, into cache_dir, the VAE included."""
    from hub_server import HubServer, serve_in_process

    from diffusion_extras.evaluation.pipeline_latent import LatentDiffusionPipeline
    with HubServer(token="hf_secret") as server:
        server.add_repo("user/latent", str(latent_runs[0]))
        serve_in_process(monkeypatch, server, tmp_path / "default-cache")
        revision = server.commits("user/latent")[-1]["oid"]
        pipe = LatentDiffusionPipeline.from_pretrained("user/latent", revision=revision, token="hf_secret",
                                                       cache_dir=tmp_path / "cache")
    assert pipe.vae_scale_factor == 2 and pipe(batch_size=1, num_inference_steps=1).images[0].size == (8, 8)
    downloads = [r["path"] for r in server.requests if "/resolve/" in r["path"]]
    assert downloads and all(f"/resolve/{revision}/" in path for path in downloads)
    assert any(path.endswith("vae/config.json") for path in downloads)
    assert list((tmp_path / "cache").glob("models--user--latent/snapshots/*/vae/config.json"))
    assert not (tmp_path / "default-cache").exists()
