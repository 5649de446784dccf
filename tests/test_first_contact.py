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
