"""What a latent run records and compares is the same in every interpreter: the VAE's fingerprint
(data/latents.py), the caches' keys, the recorded configs and the resume check; and a checkpoint
that an earlier release wrote, whose VAE fingerprint followed the interpreter's hash seed (it
hashed diffusers' `_use_default_values`, a list built from a set), still resumes, its latent cache
taken over instead of encoded again."""
import hashlib
import json
import os
import shutil

import pytest
import torch
import yaml
from helpers import TINY_RECIPE, run_training, save_from_hub_config, save_tiny_vae
from processes import launch_training

from diffusion_extras.data import latents
from diffusion_extras.training import checkpointing

SD_VAE = "runwayml--stable-diffusion-v1-5/vae/config.json"  # written by diffusers 0.6.0: 8 fields defaulted today
SD_LATENT_MODEL = {**TINY_RECIPE["model"], "in_channels": 4, "out_channels": 4}  # the tiny UNet on its latents
SD_RESOLUTION = 16  # 2x2 latents after the VAE's factor 8


def earlier_release_fingerprint(vae) -> str:
    """The VAE fingerprint as releases before this one computed it (their code): the whole
    dict(vae.config), private keys and all, then the weights."""
    digest = hashlib.sha256(json.dumps(dict(vae.config), sort_keys=True, default=str).encode())
    for name, tensor in vae.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:20]


def as_an_earlier_release_wrote_it(checkpoint, fingerprint: str | None = None) -> None:
    """The checkpoint's VAE record in an earlier release's form (no fingerprint_format; `fingerprint`
    for its fingerprint where given), its completion marker rewritten to match."""
    path = os.path.join(checkpoint, checkpointing.TRAIN_STATE)
    state = json.loads(open(path).read())
    record = state["config"]["vae"]
    del record["fingerprint_format"]
    record["fingerprint"] = fingerprint or record["fingerprint"]
    with open(path, "w") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)
    os.remove(os.path.join(checkpoint, checkpointing.MARKER))
    marker = checkpointing.completion_marker(checkpoint, state["global_step"])
    with open(os.path.join(checkpoint, checkpointing.MARKER), "w") as fh:
        json.dump(marker, fh)
    assert checkpointing.verify_checkpoint(checkpoint) is None


def test_the_fingerprint_is_of_the_stored_fields_and_weights_not_of_private_keys(tmp_path):
    """Loaded from another path, with `_use_default_values` in another order (another interpreter's),
    an SD 1.x-form VAE has the same fingerprint; a weight or a field its config.json names changes it."""
    from diffusers import AutoencoderKL
    folder = save_from_hub_config(tmp_path / "vae", SD_VAE)
    vae = AutoencoderKL.from_pretrained(folder)
    assert len(vae.config._use_default_values) == 8 and "scaling_factor" in vae.config._use_default_values
    moved = AutoencoderKL.from_pretrained(shutil.copytree(folder, tmp_path / "moved"))
    moved.register_to_config(_use_default_values=list(reversed(vae.config._use_default_values)))
    assert earlier_release_fingerprint(moved) != earlier_release_fingerprint(vae)  # the bug: order and path
    assert latents.vae_fingerprint(moved) == latents.vae_fingerprint(vae)
    with torch.no_grad():
        moved.decoder.conv_out.bias[0] += 1
    assert latents.vae_fingerprint(moved) != latents.vae_fingerprint(vae)
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.5}))
    assert latents.vae_fingerprint(AutoencoderKL.from_pretrained(folder)) != latents.vae_fingerprint(vae)


def test_an_earlier_releases_checkpoint_whose_fingerprint_can_be_recomputed_resumes(tiny_recipe, tmp_path):
    """A VAE whose config.json lacks two fields: an earlier release's fingerprint had one of two
    orders of them; the resume recomputes both, recognises it and says so."""
    from diffusers import AutoencoderKL
    folder = save_tiny_vae(tmp_path / "vae")
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k not in ("shift_factor", "mid_block_add_attention")}))
    from helpers import LATENT_MODEL
    recipe = tiny_recipe(model=LATENT_MODEL, checkpointing_steps=2)
    run_training(recipe, tmp_path / "run", "--pretrained_vae_model_name_or_path", folder, "--max_train_steps", 2)
    vae = AutoencoderKL.from_pretrained(folder)
    vae.register_to_config(_use_default_values=list(reversed(vae.config._use_default_values)))
    as_an_earlier_release_wrote_it(tmp_path / "run" / "checkpoint-2", earlier_release_fingerprint(vae))
    result = run_training(recipe, tmp_path / "run", "--pretrained_vae_model_name_or_path", folder,
                          "--max_train_steps", 3, "--resume_from_checkpoint", "latest")
    assert "resume: the checkpoint's VAE fingerprint is an earlier release's, which depended on the interpreter's " \
           "hash seed: the VAE is recognised by its fingerprint recomputed" in result.stdout


@pytest.fixture(scope="module")
def earlier_release_run(tmp_path_factory):
    """A latent run of an SD 1.x-form VAE on a folder of images (latents cached on disk), trained 2
    steps as an earlier release trained it: its latent cache keyed and its checkpoint's VAE
    recorded by that release's fingerprint, computed in this interpreter."""
    from helpers import run_training, save_random_images, write_tiny_recipe
    folder = tmp_path_factory.mktemp("earlier")
    vae = save_from_hub_config(folder / "vae", SD_VAE)
    recipe = write_tiny_recipe(folder, model=SD_LATENT_MODEL, resolution=SD_RESOLUTION, checkpointing_steps=2)
    flags = ["--train_data_dir", save_random_images(folder / "images", 16, SD_RESOLUTION, SD_RESOLUTION),
             "--cache_dir", folder / "cache", "--pretrained_vae_model_name_or_path", vae]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(latents, "vae_fingerprint", earlier_release_fingerprint)
        run_training(recipe, folder / "run", *flags, "--max_train_steps", 2)
    as_an_earlier_release_wrote_it(folder / "run" / "checkpoint-2")
    shutil.copytree(folder / "run", folder / "pristine")  # before any resume moves on
    return folder, recipe, flags


@pytest.mark.xdist_group("test_fingerprints.earlier_release_run")
def test_it_resumes_in_another_interpreter_taking_over_its_latent_cache(earlier_release_run):
    """The issue's run: a new process with another PYTHONHASHSEED resumes it (recognised by the
    measured latent statistics, the weights being uncomparable with 8! orders), and the cache the
    earlier release encoded is moved under the new key, checked against this VAE, not encoded again."""
    folder, recipe, flags = earlier_release_run
    result = launch_training(recipe, folder / "run", *flags, "--max_train_steps", 4,
                             "--resume_from_checkpoint", "latest", env={"PYTHONHASHSEED": "12345"})
    assert "the VAE is recognised by its latent normalisation and path (the weights could not be compared)" \
        in result.stdout
    assert "latents: the cache an earlier release encoded with this VAE" in result.stdout
    assert "encoded 16 images once" not in result.stdout
    state = checkpointing.read_train_state(folder / "run" / "checkpoint-4")  # records the new form
    assert state["config"]["vae"]["fingerprint_format"] == latents.FINGERPRINT_FORMAT


@pytest.mark.xdist_group("test_fingerprints.earlier_release_run")
def test_another_vae_under_its_path_is_refused_and_its_cache_not_taken(earlier_release_run, tmp_path):
    folder, recipe, flags = earlier_release_run
    run = shutil.copytree(folder / "pristine", tmp_path / "run")
    vae = save_from_hub_config(tmp_path / "vae", SD_VAE, seed=1)  # retrained: other weights, same config
    refused = run_training(recipe, run, *flags[:-1], vae, "--max_train_steps", 3,
                           "--resume_from_checkpoint", "latest", check=False)
    assert refused.returncode != 0
    assert "encoded 16 images once" in refused.stdout  # its own latents: the earlier cache is another VAE's
    assert "vae.fingerprint:" in refused.stderr and "vae.shift:" in refused.stderr


def recorded(run) -> tuple[dict, dict]:
    """(the checkpoint's recorded config, training_config.yaml) without the output folder's name."""
    state = checkpointing.read_train_state(os.path.join(run, "checkpoint-2"))["config"]
    saved = yaml.safe_load(open(os.path.join(run, "training_config.yaml")))
    return tuple({k: v for k, v in values.items() if k != "output_dir"} for values in (state, saved))


def test_two_interpreters_record_and_key_the_same_start(tiny_recipe, tmp_path):
    """The same latent run of an SD 1.x-form VAE started in two interpreters (PYTHONHASHSEED 1 and 2):
    the second finds both caches the first wrote (equal keys), they record equal configs and VAE
    fingerprints, and a third interpreter resumes the first's checkpoint."""
    from helpers import save_random_images
    recipe = tiny_recipe(model=SD_LATENT_MODEL, resolution=SD_RESOLUTION, checkpointing_steps=2)
    flags = ["--train_data_dir", save_random_images(tmp_path / "images", 16, SD_RESOLUTION, SD_RESOLUTION),
             "--cache_dir", tmp_path / "cache", "--pretrained_vae_model_name_or_path",
             save_from_hub_config(tmp_path / "vae", SD_VAE), "--max_train_steps", 2]
    first = launch_training(recipe, tmp_path / "a", *flags, env={"PYTHONHASHSEED": "1"})
    second = launch_training(recipe, tmp_path / "b", *flags, env={"PYTHONHASHSEED": "2"})
    assert "decoded 16 images once" in first.stdout and "encoded 16 images once" in first.stdout
    assert "decoded 16 images once" not in second.stdout and "encoded 16 images once" not in second.stdout
    assert recorded(tmp_path / "a") == recorded(tmp_path / "b")
    launch_training(recipe, tmp_path / "a", *flags[:-1], 3, "--resume_from_checkpoint", "latest",
                    env={"PYTHONHASHSEED": "3"})
