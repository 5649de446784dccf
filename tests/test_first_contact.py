"""The commands a new user types first, through the real command line: every --help, a bad
--config file, training on an image folder (the model follows the images), diffusers'
train_unconditional.py command lines, and what the end of a run shows."""
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import TINY_RECIPE

ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")

# (command, a flag the help must list, words of that flag's help line)
HELP_CASES = [
    (["train_ddpm.py"], "--gradient_checkpointing", "~30-40% less"),
    (["train_ddpm.py"], "--snr_gamma", "on resume: apply"),
    (["-m", "diffusion_extras.sample"], "--scheduler", "DPM-Solver++"),
    (["-m", "diffusion_extras.evaluate"], "--reference", "folder of reference images"),
    (["-m", "diffusion_extras.report"], "run_dir", "the training output_dir"),
    (["-m", "diffusion_extras.posthoc_ema"], "--sigma_rels", "relative EMA widths"),
]


def _one_spaced(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("command,flag,words", HELP_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_every_cli_help_exits_0_and_describes_its_flags(run_cli, command, flag, words):
    result = run_cli(command + ["--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert flag in result.stdout and words in _one_spaced(result.stdout)


def test_accelerate_launch_help_shows_the_training_flags(run_cli, tmp_path):
    # config-free, on CPU, offline: what a user types before `accelerate config`
    env = {"ACCELERATE_USE_CPU": "1", "ACCELERATE_CONFIG_FILE": None, "HF_HOME": str(tmp_path / "hf_home")}
    result = run_cli(["launch", "train_ddpm.py", "--help"], launcher=[ACCELERATE], env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    text = _one_spaced(result.stdout)
    assert "--gradient_checkpointing" in text and "~30-40% less activation memory" in text
    assert "--resolution" in text and "One of: epsilon, v_prediction, sample." in text


def test_help_is_rendered_from_the_field_metadata():
    from diffusion_extras import config
    text = _one_spaced(config.build_parser().format_help())
    for f in config.config_fields():
        rendered = _one_spaced(config.help_text(f).replace("%%", "%"))
        assert rendered in text, f.name


# ------------------------------------------------------------------ a bad --config file
def _bad_config_cases(tmp_path):
    not_utf8 = tmp_path / "latin1.yaml"
    not_utf8.write_bytes("learning_rate: 1e-4  # réglage\n".encode("latin-1"))
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("learning_rate: 1e-4\nmodel: [1, 2\nseed: 3\n")
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- learning_rate\n- 1e-4\n")
    unreadable = tmp_path / "secret.yaml"
    unreadable.write_text("seed: 1\n")
    unreadable.chmod(0)
    folder = tmp_path / "recipes"
    folder.mkdir()
    return [(not_utf8, "not UTF-8 text (byte 0xe9"), (not_yaml, "not valid YAML at line 3"),
            (a_list, "expected a mapping of setting: value at the top level, got a list"),
            (unreadable, "cannot read it (Permission denied)"), (folder, "is a folder; give a YAML file")]


def test_bad_config_file_is_one_line_naming_the_file(run_cli, tmp_path):
    for path, problem in _bad_config_cases(tmp_path):
        if problem.startswith("cannot read") and os.access(path, os.R_OK):
            continue  # root reads any file: permissions cannot be tested here
        result = run_cli(["train_ddpm.py", "--config", str(path), "--output_dir", str(tmp_path / "out")],
                         timeout=120)
        assert result.returncode == 2, (path, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines == [lines[0]] and lines[0].startswith(f"error: --config {path}") and problem in lines[0], lines
        assert not (tmp_path / "out").exists()


def test_unreadable_config_is_reported_even_as_root(tmp_path, monkeypatch):
    """root can read a chmod-0 file, so the permission case is also checked by failing the open."""
    import builtins

    from diffusion_extras import config
    path = tmp_path / "recipe.yaml"
    path.write_text("seed: 1\n")
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(config.ConfigError, match=r"recipe.yaml: cannot read it \(Permission denied\)"):
        config.load_yaml(str(path))


# ------------------------------------------------------------------ the model follows the images
def _image_folder(folder, mode, count=12, size=20):
    rng = np.random.default_rng(0)
    folder.mkdir()
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(folder / f"{index:02d}.png")
    return str(folder)


QUICK = ["--resolution", "16", "--max_train_steps", "2", "--train_batch_size", "4", "--eval_batch_size", "1",
         "--ddpm_num_inference_steps", "1", "--logger", "none"]
MERGED = ["bash", "-c", 'exec "$@" 2>&1', "bash", sys.executable]  # stderr (the bar) and stdout in order


@pytest.mark.parametrize("mode,channels,colour", [("RGB", 3, "RGB"), ("L", 1, "grayscale")])
def test_image_folder_without_a_recipe_trains_a_model_of_its_channels(run_cli, tmp_path, mode, channels, colour):
    folder = _image_folder(tmp_path / "images", mode)
    out = tmp_path / "run"
    result = run_cli(["train_ddpm.py", "--train_data_dir", folder, "--output_dir", str(out), *QUICK],
                     launcher=MERGED, check=True)
    model_lines = [line for line in result.stdout.splitlines() if line.startswith("model: ")]
    assert len(model_lines) == 1, result.stdout[-3000:]
    assert f"{channels} channel(s) ({colour})" in model_lines[0] and "1.1M parameters" in model_lines[0]
    assert "converting" not in result.stdout  # nothing converted: the model follows the images
    unet = json.loads((out / "unet" / "config.json").read_text())
    assert unet["in_channels"] == unet["out_channels"] == channels and unet["sample_size"] == 16
    saved = yaml.safe_load((out / "training_config.yaml").read_text())
    assert saved["model"]["in_channels"] == channels  # the saved config reproduces the run
    # end-of-run work shows itself, after the training bar has closed at the last step
    text = result.stdout.replace("\r", "\n")
    last_bar = text.rindex("optimizer steps:")
    assert "2/2" in text[last_bar:].splitlines()[0]
    for what in ("final sample grid (1 images, 1 DDIM steps)", "pipeline export"):
        assert re.search(re.escape(what) + r": done in \d+\.\d s", text), what
        assert text.index(what) > last_bar
    assert re.search(r"health report: \S+training_report.md \(written in \d+\.\d s\)", text)


def test_a_recipe_model_keeps_its_channels_and_the_conversion_is_announced_once(run_cli, tmp_path, tiny_recipe):
    folder = _image_folder(tmp_path / "images", "RGB")
    out = tmp_path / "run"
    result = run_cli(["train_ddpm.py", "--config", tiny_recipe(), "--train_data_dir", folder,
                      "--output_dir", str(out), "--max_train_steps", "1"], check=True)
    assert result.stdout.count("converting them to grayscale") == 1
    assert "the images are RGB and the UNet has 1 channel(s)" in result.stdout
    assert json.loads((out / "unet" / "config.json").read_text())["in_channels"] == 1


def test_diffusers_default_unet_at_multiples_of_32_px():
    """At 32 px with RGB images and no model chosen: exactly the UNet that diffusers'
    train_unconditional.py builds (its literal arguments below), and its parameter count."""
    from diffusers import UNet2DModel

    from diffusion_extras import models
    from diffusion_extras.config import TrainConfig
    config = TrainConfig(train_data_dir=".", resolution=32)
    config.model, chosen = models.follow_data(config, 3)
    assert "diffusers train_unconditional.py's default UNet at 32 px" in chosen
    ours = models.build_unet(config)
    theirs = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"))
    def public(config):  # JSON form: tuples and lists compare equal, as in the saved config.json
        return json.loads(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))
    assert public(ours.config) == public(theirs.config)
    assert models.count_parameters(ours) == models.count_parameters(theirs)
    assert "113.7M parameters" in models.describe(ours, chosen, 3)[0]
    # the embedded digits keep the digits recipe, whatever the resolution
    digits = TrainConfig(resolution=32)
    assert models.follow_data(digits, 1)[0] == digits.model


def test_image_channels_follow_the_pil_mode(tmp_path):
    from diffusion_extras import data
    items = []
    for mode in ("L", "1", "I;16", "LA"):
        path = tmp_path / f"{mode.replace(';', '')}.png"
        Image.new(mode, (4, 4)).save(path)
        items.append({"path": str(path), "bytes": None})
    assert data.stored_channels(items) == 1
    for mode in ("RGB", "RGBA", "P"):
        path = tmp_path / f"{mode}.png"
        Image.new(mode, (4, 4)).save(path)
        assert data.stored_channels(items + [{"path": str(path), "bytes": None}]) == 3
    assert data.stored_channels([{"path": str(tmp_path / "missing.png"), "bytes": None}]) is None
