"""Tests for diffusion_extras/cli/common.py, the helpers the command lines share; each command line's own
end-to-end tests are in test_sampling.py, test_evaluation.py and test_posthoc_ema.py."""
import argparse
import json

import pytest
import torch
import yaml
from conftest import TINY_RECIPE, save_tiny_pipeline
from diffusers import UNet2DModel

from diffusion_extras.cli.arguments import one_line_errors, positive_int
from diffusion_extras.cli.common import load_pipeline, pipeline_resolution, resolve_device


def test_positive_int_refuses_zero_and_negatives():
    assert positive_int("3") == 3
    for text in ("0", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
            positive_int(text)


def test_resolve_device_names_the_flag_in_its_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")


@pytest.mark.parametrize("error", [ValueError("bad value"), FileNotFoundError("no such file"),
                                   PermissionError("read-only")])
def test_bad_input_and_unreadable_files_are_one_line_errors_with_exit_2(capsys, error):
    with pytest.raises(SystemExit) as exit_info, one_line_errors():
        raise error
    assert exit_info.value.code == 2 and capsys.readouterr().err == f"error: {error}\n"


def test_load_pipeline_reads_a_training_output_folder(tmp_path):
    pipeline = load_pipeline(save_tiny_pipeline(tmp_path / "run", channels=3))
    assert isinstance(pipeline.unet, UNet2DModel) and pipeline.scheduler.config.num_train_timesteps == 100
    assert pipeline_resolution(pipeline) == 8


def test_load_pipeline_rejects_bad_inputs(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pipeline(str(tmp_path / "missing" / "run"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model_index.json"):
        load_pipeline(str(tmp_path / "empty"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_pipeline(str(tmp_path / "file.txt"))
    conditional = tmp_path / "sd"
    conditional.mkdir()
    (conditional / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
        "scheduler": ["diffusers", "PNDMScheduler"]}))
    with pytest.raises(ValueError, match="expected an unconditional DDPMPipeline"):
        load_pipeline(str(conditional))
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="is not a local folder and the Hub is offline"):
        load_pipeline("someone/ddpm-model-that-is-not-cached")


def test_importing_the_stack_imports_without_the_collector_then_freezes_what_was_made():
    """commands.importing_the_stack: the cyclic collector is off inside (the heavy imports), on
    again after, and what was made inside is frozen (left out of later collections); a caller that
    had the collector off keeps it off, and an import that fails still restores it."""
    import gc

    from diffusion_extras.core import commands
    frozen = gc.get_freeze_count()
    inside = []
    try:
        with commands.importing_the_stack():
            inside.append(gc.isenabled())
            made = [[] for _ in range(1000)]  # tracked objects, as a module's import makes
        assert inside == [False] and gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
        with pytest.raises(ImportError), commands.importing_the_stack():
            raise ImportError("a missing library")
        assert gc.isenabled()
        gc.disable()
        with commands.importing_the_stack():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()  # this test process's objects back in the collector's sight


def test_the_trainer_imports_its_stack_inside_importing_the_stack(monkeypatch, tmp_path):
    """main() imports torch, diffusers and the rest (training.build) inside importing_the_stack and
    sets the run up after it (here a setup that refuses at once: exit code 2)."""
    import contextlib

    from diffusion_extras.core import commands
    from diffusion_extras.training import build
    from diffusion_extras.training.config import ConfigError
    from diffusion_extras.training.main import main
    events = []

    @contextlib.contextmanager
    def recording():
        events.append("importing")
        yield
        events.append("imported")

    def setup(config, hooks):
        events.append("setup")
        raise ConfigError("refused here")
    monkeypatch.setattr(commands, "importing_the_stack", recording)
    monkeypatch.setattr(build, "setup", setup)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(TINY_RECIPE))
    assert main(["--config", str(recipe), "--output_dir", str(tmp_path / "run")]) == 2
    assert events == ["importing", "imported", "setup"]
