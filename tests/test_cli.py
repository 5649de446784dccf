"""Tests for diffusion_extras/cli/common.py, the helpers the command lines share; each command line's own
end-to-end tests are in test_sampling.py, test_evaluation.py and test_posthoc_ema.py."""
import argparse
import json
import os

import pytest
import torch
import yaml
from diffusers import UNet2DModel
from helpers import TINY_RECIPE, run_cli, run_training, save_tiny_pipeline, tiny_unet
from processes import run_command

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
    with pytest.raises(ValueError, match="is not a local folder and cannot be downloaded: HF_HUB_OFFLINE is set"):
        load_pipeline("someone/ddpm-model-that-is-not-cached")


IMPORTING_THE_STACK = """
import gc, json, sys
from diffusion_extras.core import commands
report = {"torch before": "torch" in sys.modules, "frozen before": gc.get_freeze_count()}
with commands.importing_the_stack():
    report["collector while importing"] = gc.isenabled()
    import torch
report.update({"collector after": gc.isenabled(), "frozen after": gc.get_freeze_count()})
try:
    with commands.importing_the_stack():
        raise ImportError("a missing library")
except ImportError:
    report["collector after a failed import"] = gc.isenabled()
print(json.dumps(report))
"""


def test_importing_the_stack_imports_without_the_collector_then_freezes_what_was_made(tmp_path):
    """commands.importing_the_stack, in a process of its own (a command's process before it has
    imported torch; this one has): the cyclic collector is off while torch imports and on again after, torch's
    objects are frozen (left out of later collections), and an import that fails still leaves
    the collector on."""
    import json
    script = tmp_path / "importing.py"
    script.write_text(IMPORTING_THE_STACK)
    result = run_command([script])
    report = json.loads(result.stdout)
    assert not report.pop("torch before") and report.pop("frozen before") == 0
    assert report.pop("frozen after") > 100_000  # torch's module-level objects, at the least
    assert report == {"collector while importing": False, "collector after": True,
                      "collector after a failed import": True}


def test_importing_the_stack_leaves_a_program_that_has_torch_alone():
    """Where torch is imported already (this test process, a notebook calling a command's main()):
    nothing frozen, the collector as it was."""
    import gc

    from diffusion_extras.core import commands
    frozen, inside = gc.get_freeze_count(), []
    with commands.importing_the_stack():
        inside.append(gc.isenabled())
        made = [[] for _ in range(1000)]
    assert inside == [True] and gc.isenabled() and gc.get_freeze_count() == frozen and made


def test_the_trainer_imports_its_stack_inside_importing_the_stack(monkeypatch, tmp_path):
    """main() imports torch, diffusers and the rest (training.build) inside importing_the_stack and
    sets the run up after it (here a setup that refuses at once: exit code 2)."""
    import contextlib

    from diffusion_extras.core import commands
    from diffusion_extras.training import build
    from diffusion_extras.training.config import ConfigError
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
    assert run_training(recipe, tmp_path / "run", check=False).returncode == 2
    assert events == ["importing", "imported", "setup"]


def test_load_pipeline_reads_the_trainers_class_conditional_export_from_the_hub(tmp_path, monkeypatch):
    """What the trainer's --push_to_hub uploads (model_index.json naming its pipeline file) loads
    by Hub id as the package's ClassConditionalPipeline, its classes with it, without running the
    uploaded file; the sample command samples it by class name. An unconditional repo loads as a
    DDPMPipeline and a foreign custom pipeline is refused before its weights are downloaded."""
    from diffusers import DDPMPipeline, DDPMScheduler
    from hub_server import HubServer, serve_in_process

    from diffusion_extras.evaluation.pipeline_class_conditional import ClassConditionalPipeline
    from diffusion_extras.training.models import save_class_conditional

    save_class_conditional(tiny_unet(num_class_embeds=4), DDPMScheduler(num_train_timesteps=100), ["ant", "bee", "cat"],
                           str(tmp_path / "conditional"))
    foreign = tmp_path / "foreign"
    save_tiny_pipeline(foreign)
    (foreign / "model_index.json").write_text(json.dumps({
        "_class_name": ["pipeline_other", "OtherPipeline"], "unet": ["diffusers", "UNet2DModel"],
        "scheduler": ["diffusers", "DDPMScheduler"]}))
    with HubServer() as server:
        server.add_repo("someone/conditional", str(tmp_path / "conditional"))
        server.add_repo("someone/unconditional", save_tiny_pipeline(tmp_path / "unconditional"))
        server.add_repo("someone/foreign", str(foreign))
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        pipeline = load_pipeline("someone/conditional")
        assert type(pipeline) is ClassConditionalPipeline and pipeline.id2label == {0: "ant", 1: "bee", 2: "cat"}
        assert type(load_pipeline("someone/unconditional")) is DDPMPipeline
        with pytest.raises(ValueError, match=r"holds a custom pipeline \['pipeline_other', 'OtherPipeline'\]"):
            load_pipeline("someone/foreign")
        assert not any("foreign/resolve/main/unet" in request["path"] for request in server.requests)
        result = run_cli(["-m", "diffusion_extras.sample", "someone/conditional", "--class_labels", "bee",
                          "--num_images", "2", "--output", tmp_path / "images", "--num_inference_steps", "2",
                          "--device", "cpu"])
    assert "wrote 2 images" in result.stdout
    assert sorted(os.listdir(tmp_path / "images")) == ["000000.png", "000001.png", "grid.png"]


def test_a_hub_id_offline_and_not_in_the_cache_names_hf_hub_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(ValueError, match=r"HF_HUB_OFFLINE is set and someone/ddpm-tiny is not in the Hub cache "
                                         r"\(.*empty_cache\): unset HF_HUB_OFFLINE to download it"):
        load_pipeline("someone/ddpm-tiny")

