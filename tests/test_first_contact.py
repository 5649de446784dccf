"""The commands a new user types first, through the real command line: every --help, a bad
--config file, training on an image folder (the model follows the images), diffusers'
train_unconditional.py command lines, and what the end of a run shows. The commands run through
their main() in this process; in processes of their own where the process is the subject: what
--help and the early refusals import (no torch), and `accelerate launch`."""
import json
import os
import re
import sys

import numpy as np
import pytest
import yaml
from helpers import run_cli, run_training
from PIL import Image
from processes import run_command

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
def test_every_cli_help_exits_0_and_describes_its_flags(command, flag, words):
    result = run_cli(command + ["--help"])
    assert "Traceback" not in result.stdout + result.stderr
    assert flag in result.stdout and words in _one_spaced(result.stdout)


def test_accelerate_launch_help_shows_the_training_flags(tmp_path):
    # config-free, on CPU, offline: what a user types before `accelerate config` (the launcher: a process)
    env = {"ACCELERATE_USE_CPU": "1", "ACCELERATE_CONFIG_FILE": None, "HF_HOME": str(tmp_path / "hf_home")}
    result = run_command(["launch", "train_ddpm.py", "--help"], launcher=[ACCELERATE], env=env, timeout=180)
    assert "Traceback" not in result.stdout + result.stderr
    text = _one_spaced(result.stdout)
    assert "--gradient_checkpointing" in text and "~30-40% less activation memory" in text
    assert "--resolution" in text and "One of: epsilon, v_prediction, sample." in text


def test_help_is_rendered_from_the_field_metadata():
    from diffusion_extras.training import config
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


def test_bad_config_file_is_one_line_naming_the_file(tmp_path):
    for path, problem in _bad_config_cases(tmp_path):
        if problem.startswith("cannot read") and os.access(path, os.R_OK):
            continue  # root reads any file: permissions cannot be tested here
        result = run_cli(["train_ddpm.py", "--config", str(path), "--output_dir", str(tmp_path / "out")], check=False)
        assert result.returncode == 2, (path, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines == [lines[0]] and lines[0].startswith(f"error: --config {path}") and problem in lines[0], lines
        assert not (tmp_path / "out").exists()


def test_unreadable_config_is_reported_even_as_root(tmp_path, monkeypatch):
    """root can read a chmod-0 file, so the permission case is also checked by failing the open."""
    import builtins

    from diffusion_extras.training import config
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


# ------------------------------------------------------------------ answers before torch loads
# What --help and a bad flag must not import: the commands' stack (seconds on a laptop). The training
# config validates against core/choices.py and evaluation/choices.py, the sample and evaluate flags
# come from cli/arguments.py and evaluation/choices.py; each command imports its work once its flags
# are good (the report's checks, once they rebuild the noise schedule). Each runs as a process of its
# own, started with -X importtime: this one has the stack imported.
HEAVY = ("torch", "diffusers", "datasets", "transformers", "accelerate", "scipy", "sklearn", "matplotlib", "pandas")
IMPORT_TIME = [sys.executable, "-X", "importtime"]  # a process listing each module it imports on stderr


def _run_listing_imports(args, module):
    """(the result, the HEAVY modules the command imported, its stderr lines but the import list) of
    `python ARGS` in a process of its own."""
    result = run_command(args, launcher=IMPORT_TIME, timeout=120, check=False)
    stderr = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in stderr if line.startswith("import time:")}
    assert module in imported  # the list is there: the command's own module is in it
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    return result, heavy, [line for line in stderr if line.strip() and not line.startswith("import time:")]


def _bad_recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def _earlier_run(tmp_path):
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)  # the output_dir the test passes holds a run
    return []


LIGHT_CASES = [  # (flags, the one line's words; None: --help)
    (lambda tmp: ["--help"], None),
    (lambda tmp: ["--prediction_type", "nonsense"], "--prediction_type 'nonsense' is not one of: epsilon"),
    (lambda tmp: ["--lr_scheduler", "cosine_annealing"], "--lr_scheduler 'cosine_annealing' is not one of"),
    (lambda tmp: ["--eval_metrics", "fid,is"], "--eval_metrics 'fid,is': choose a comma list of fid"),
    (lambda tmp: ["--background", "grey"], "--background 'grey': give white, black or a colour #rrggbb"),
    (lambda tmp: ["--resolution", "18"], "--resolution 18 cannot be halved 2 times"),
    (lambda tmp: ["--learning_rate", "fast"], "argument --learning_rate: invalid float value: 'fast'"),
    (lambda tmp: ["--config", _bad_recipe(tmp, "seed: [1\n")], "not valid YAML at line 2"),
    (lambda tmp: ["--config", _bad_recipe(tmp, "learning_rat: 1e-4\n")],
     "unknown setting(s) in the recipe: learning_rat"),
    # what the run itself can refuse without torch: a data folder, the output_dir, the Hub push
    (lambda tmp: ["--dataset_name", "./no/such/folder"], "--dataset_name ./no/such/folder: no such folder"),
    (lambda tmp: ["--train_data_files", f"{tmp}/shards/train-*.tar"], "train-*.tar matches no file"),
    (lambda tmp: ["--train_data_files", "README.md"], "must name only .tar shards or only .parquet files"),
    # a mistyped local VAE folder: a bare name is no Hub id (namespace/name), so the Hub is not asked
    (lambda tmp: ["--pretrained_vae_model_name_or_path", "digits-vea"],
     "--pretrained_vae_model_name_or_path digits-vea: VAE folder digits-vea does not exist (nor is it a Hub id"),
    (_earlier_run, "already holds checkpoint-2: pass --resume_from_checkpoint latest to continue it"),
    (lambda tmp: ["--eval_steps", "1"], "offline (HF_HUB_OFFLINE=1), so the Inception detector cannot be downloaded"),
    (lambda tmp: ["--push_to_hub"], "--push_to_hub needs a token: pass --hub_token"),
    (lambda tmp: ["--push_to_hub", "--hub_token", "hf_test"], "--push_to_hub cannot work in offline mode"),
]


@pytest.mark.parametrize("flags,words", LIGHT_CASES, ids=lambda v: None if callable(v) else str(v)[:30])
def test_help_and_config_errors_answer_without_importing_the_training_stack(tmp_path, flags, words):
    flags = flags(tmp_path)
    before = sorted(os.walk(tmp_path / "out"))  # what the case put there (_earlier_run), else nothing
    result, heavy, lines = _run_listing_imports(["train_ddpm.py", *flags, "--output_dir", str(tmp_path / "out")],
                                                "diffusion_extras.training.config")
    assert heavy == []
    if words is None:
        assert result.returncode == 0 and lines == [] and "--prediction_type" in result.stdout
    else:
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert words in lines[0], lines
    assert sorted(os.walk(tmp_path / "out")) == before


@pytest.mark.parametrize("command,flag,needed", [
    ("sample", "--scheduler", ["--output", "out"]), ("evaluate", "--scheduler", ["--reference", "images"]),
    ("posthoc_ema", "--feature_extractor", ["--sigma_rels", "0.1"])])
def test_command_help_and_a_bad_flag_answer_without_importing_torch(tmp_path, command, flag, needed):
    module, parser = f"diffusion_extras.{command}", f"diffusion_extras.cli.{command}"
    result, heavy, _ = _run_listing_imports(["-m", module, "--help"], parser)
    assert result.returncode == 0 and flag in result.stdout and heavy == []
    result, heavy, lines = _run_listing_imports(["-m", module, str(tmp_path), *needed, flag, "heun"], parser)
    assert result.returncode == 2 and f"argument {flag}: invalid choice: 'heun'" in lines[-1], lines
    assert heavy == []


UNCONDITIONAL_FLAG = ("this pipeline is unconditional (a DDPMPipeline) and has no --guide; drop the flag or give "
                      "a --guide")
PIPELINE_CASES = [  # (command, PIPELINE, its other arguments, the one line); "plain": a saved DDPMPipeline
    ("sample", "no/such/../../folder", ["--output", "o"], "error: pipeline folder no/such/../../folder does not exist"),
    ("sample", "images", ["--output", "o"], "is not a diffusers pipeline folder (no model_index.json)"),
    ("sample", "ddpm-digts", ["--output", "o"], "error: pipeline folder ddpm-digts does not exist (nor is it a Hub id"),
    ("sample", "plain/model_index.json", ["--output", "o"], "model_index.json is a file; pass the pipeline folder"),
    ("sample", "plain", ["--output", "o", "--class_labels", "3"], f"error: --class_labels: {UNCONDITIONAL_FLAG}"),
    ("sample", "conditional", ["--output", "o", "--class_labels", "1,eleven"],
     "error: --class_labels: unknown class 'eleven'; the classes are 0 (zero), 1 (one)"),
    ("evaluate", "plain", ["--reference", "images", "--guidance_interval", "0.3,5"],
     f"error: --guidance_interval: {UNCONDITIONAL_FLAG}"),
    ("evaluate", "plain", ["--reference", "nowhere"], "error: --reference nowhere is neither a folder of images nor"),
    ("evaluate", "plain", ["--reference", "images", "--eval_metrics", "kid"],
     "error: offline (HF_HUB_OFFLINE=1), so the Inception detector cannot be downloaded"),
]


@pytest.mark.parametrize("command,pipeline,rest,words", PIPELINE_CASES, ids=lambda v: str(v)[:24])
def test_a_pipeline_or_reference_that_cannot_serve_answers_without_importing_torch(
        tmp_path, command, pipeline, rest, words):
    """The files the sample and evaluate commands read are checked before torch loads: one line,
    exit 2, none of the HEAVY libraries imported (the same refusals once loaded: test_sampling,
    test_class_conditional, test_evaluation, test_metric_backbones)."""
    from diffusers import DDPMScheduler
    from helpers import save_tiny_pipeline, tiny_unet

    from diffusion_extras.training.models import save_class_conditional
    save_tiny_pipeline(tmp_path / "plain")
    save_class_conditional(tiny_unet(num_class_embeds=3), DDPMScheduler(num_train_timesteps=100), ["zero", "one"],
                           str(tmp_path / "conditional"))
    (tmp_path / "images").mkdir()
    args = [str(tmp_path / part) if part in ("images", "nowhere", "o", "conditional") or part.startswith("plain")
            else part for part in [pipeline, *rest]]
    module, parser = f"diffusion_extras.{command}", f"diffusion_extras.cli.{command}"
    result, heavy, lines = _run_listing_imports(["-m", module, *args], parser)
    assert result.returncode == 2 and len(lines) == 1 and words in lines[0].replace(str(tmp_path) + "/", ""), lines
    assert heavy == []
    assert not os.path.exists(tmp_path / "o")


def test_report_help_and_a_missing_run_answer_without_importing_torch(tmp_path):
    module, marker = "diffusion_extras.report", "diffusion_extras.report.health"
    result, heavy, _ = _run_listing_imports(["-m", module, "--help"], marker)
    assert result.returncode == 0 and "run_dir" in result.stdout and heavy == []
    result, heavy, lines = _run_listing_imports(["-m", module, str(tmp_path / "no_run")], marker)
    assert result.returncode == 2 and lines == [f"error: {tmp_path / 'no_run'}: no such directory; pass a training "
                                                "output_dir or a checkpoint in it"], lines
    assert heavy == []


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


@pytest.mark.parametrize("mode,channels,colour", [("RGB", 3, "RGB"), ("L", 1, "grayscale")])
def test_image_folder_without_a_recipe_trains_a_model_of_its_channels(tmp_path, mode, channels, colour):
    folder = _image_folder(tmp_path / "images", mode)
    out = tmp_path / "run"
    result = run_cli(["train_ddpm.py", "--train_data_dir", folder, "--output_dir", out, *QUICK],
                                check=True, merge_stderr=True)
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
    for what in ("final sample grid (1 images, 1 DDIM steps", "pipeline export"):  # the grid's line: its cost too
        assert re.search(re.escape(what) + r"[^\n]*: done in \d+\.\d s", text), what
        assert text.index(what) > last_bar
    assert re.search(r"health report: \S+training_report.md \(written in \d+\.\d s\)", text)


def test_a_recipe_model_keeps_its_channels_and_the_conversion_is_announced_once(tmp_path, tiny_recipe):
    folder = _image_folder(tmp_path / "images", "RGB")
    out = tmp_path / "run"
    result = run_training(tiny_recipe(), out, "--train_data_dir", folder, "--max_train_steps", 1)
    assert result.stdout.count("converting them to grayscale") == 1
    assert "the images are RGB and the UNet has 1 channel(s)" in result.stdout
    assert json.loads((out / "unet" / "config.json").read_text())["in_channels"] == 1


def test_diffusers_default_unet_at_multiples_of_32_px():
    """At 32 px with RGB images and no model chosen: exactly the UNet that diffusers'
    train_unconditional.py builds (its literal arguments below), and its parameter count."""
    from diffusers import UNet2DModel

    from diffusion_extras.training import models
    from diffusion_extras.training.config import TrainConfig
    config = TrainConfig(train_data_dir=".", resolution=32)
    model, _, chosen, _ = models.follow_data(config, 3)
    assert "diffusers train_unconditional.py's default UNet at 32 px" in chosen
    ours = models.build_unet(config, model)
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
    assert models.follow_data(digits, 1).model == digits.model


def test_image_channels_follow_the_pil_mode(tmp_path):
    from diffusion_extras.data import images as data
    items = []
    for mode in ("L", "1", "I;16", "LA"):
        path = tmp_path / f"{mode.replace(';', '')}.png"
        Image.new(mode, (4, 4)).save(path)
        items.append({"path": str(path), "bytes": None})
    assert data.stored_channels(items) == 1
    for mode in ("RGB", "RGBA", "P"):
        path = tmp_path / f"{mode}.png"
        Image.new("RGB", (4, 4), "teal").convert(mode).save(path)  # a palette of colours: a grey one is grayscale
        assert data.stored_channels(items + [{"path": str(path), "bytes": None}]) == 3
    assert data.stored_channels([{"path": str(tmp_path / "missing.png"), "bytes": None}]) is None


# ------------------------------------------------------------------ diffusers' command lines
# examples/unconditional_image_generation/README.md (diffusers), Hub ids replaced by a local folder.
README_FLOWERS = ("--dataset_name={data} --resolution=64 --center_crop --random_flip "
                  "--output_dir=ddpm-ema-flowers-64 --train_batch_size=16 --num_epochs=100 "
                  "--gradient_accumulation_steps=1 --use_ema --learning_rate=1e-4 --lr_warmup_steps=500 "
                  "--mixed_precision=no --push_to_hub")
README_MULTI_GPU = ("--dataset_name={data} --resolution=64 --center_crop --random_flip "
                    "--output_dir=ddpm-ema-pokemon-64 --train_batch_size=16 --num_epochs=100 "
                    "--gradient_accumulation_steps=1 --use_ema --learning_rate=1e-4 --lr_warmup_steps=500 "
                    "--mixed_precision=no --logger=wandb")  # the README's fp16 needs a GPU: no here
# every other flag of train_unconditional.py, with a value of its own meaning
OTHER_DIFFUSERS_FLAGS = ("--dataset_config_name=default --cache_dir=cache --eval_batch_size=16 "
                         "--dataloader_num_workers=0 --save_images_epochs=10 --save_model_epochs=10 "
                         "--lr_scheduler=cosine_with_restarts --adam_beta1=0.95 --adam_beta2=0.999 "
                         "--adam_weight_decay=1e-6 --adam_epsilon=1e-08 --ema_inv_gamma=1.0 --ema_power=0.75 "
                         "--ema_max_decay=0.9999 --hub_model_id=me/flowers --hub_private_repo --logging_dir=logs "
                         "--local_rank=-1 --prediction_type=sample --ddpm_num_steps=1000 "
                         "--ddpm_num_inference_steps=1000 --ddpm_beta_schedule=sigmoid --checkpointing_steps=500 "
                         "--checkpoints_total_limit=3 --overwrite_output_dir "
                         "--enable_xformers_memory_efficient_attention")


def test_diffusers_readme_command_lines_parse_with_the_same_meaning(tmp_path):
    from diffusion_extras.training.config import parse_config
    data = str(tmp_path)
    flowers = parse_config(README_FLOWERS.format(data=data).split())
    assert (flowers.dataset_name, flowers.resolution, flowers.center_crop, flowers.random_flip) == \
        (data, 64, True, True)
    assert (flowers.output_dir, flowers.train_batch_size, flowers.gradient_accumulation_steps) == \
        ("ddpm-ema-flowers-64", 16, 1)
    assert flowers.num_epochs == 100 and flowers.max_train_steps is None  # epochs decide, as in diffusers
    assert (flowers.use_ema, flowers.learning_rate, flowers.lr_warmup_steps) == (True, 1e-4, 500)
    assert (flowers.mixed_precision, flowers.push_to_hub) == ("no", True)
    multi = parse_config(README_MULTI_GPU.format(data=data).split())
    assert multi.logger == "wandb" and multi.output_dir == "ddpm-ema-pokemon-64"
    other = parse_config(README_FLOWERS.format(data=data).split() + OTHER_DIFFUSERS_FLAGS.split())
    assert (other.dataset_config_name, other.cache_dir, other.eval_batch_size) == ("default", "cache", 16)
    assert (other.save_images_epochs, other.save_model_epochs, other.lr_scheduler) == (10, 10, "cosine_with_restarts")
    assert (other.adam_beta1, other.adam_weight_decay, other.ema_max_decay, other.ema_power) == \
        (0.95, 1e-6, 0.9999, 0.75)
    assert (other.hub_model_id, other.hub_private_repo, other.local_rank) == ("me/flowers", True, -1)
    assert (other.prediction_type, other.ddpm_num_inference_steps, other.ddpm_beta_schedule) == \
        ("sample", 1000, "sigmoid")
    assert (other.checkpointing_steps, other.checkpoints_total_limit) == (500, 3)
    assert other.overwrite_output_dir and other.enable_xformers_memory_efficient_attention


def test_contradictory_diffusers_flags_are_one_line_naming_why(tmp_path):
    # (--preserve_input_precision is accepted: tests/test_image_formats.py trains 16-bit images with it)
    both = run_cli(["train_ddpm.py", "--overwrite_output_dir", "--resume_from_checkpoint", "latest"], check=False)
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_diffusers_readme_training_on_own_folder(tmp_path):
    """README's "use your own data" line with the flowers flags, scaled to a CPU test: the epoch
    intervals become step intervals (stated), --overwrite_output_dir moves the earlier run aside,
    xformers is answered by SDPA, and the RGB images give an RGB pipeline."""
    folder = _image_folder(tmp_path / "images", "RGB", count=8)
    out = tmp_path / "ddpm-ema-flowers"
    out.mkdir()
    (out / "checkpoint-7").mkdir()  # an earlier run: kept, moved aside
    (out / "checkpoint-7" / "note.txt").write_text("earlier")
    command = (f"--train_data_dir {folder} --resolution=16 --center_crop --random_flip --output_dir={out} "
               "--train_batch_size=4 --num_epochs=2 --gradient_accumulation_steps=1 --use_ema --learning_rate=1e-4 "
               "--lr_warmup_steps=1 --mixed_precision=no --save_images_epochs=1 --save_model_epochs=1 "
               "--overwrite_output_dir --enable_xformers_memory_efficient_attention --local_rank=0 "
               "--eval_batch_size=1 --ddpm_num_inference_steps=1 --logger=tensorboard --checkpointing_steps=2 "
               "--checkpoints_total_limit=1")
    result = run_cli(["train_ddpm.py", *command.split()])
    assert "--save_images_epochs 1 -> --save_images_steps 2 (2 optimizer steps per epoch)" in result.stdout
    assert "--save_model_epochs 1 -> --save_model_steps 2 (2 optimizer steps per epoch)" in result.stdout
    assert "scaled_dot_product_attention" in result.stdout
    moved = [p for p in os.listdir(tmp_path) if p.startswith("ddpm-ema-flowers.previous-")]
    assert len(moved) == 1 and (tmp_path / moved[0] / "checkpoint-7" / "note.txt").read_text() == "earlier"
    assert f"the earlier run in {out} is now {tmp_path / moved[0]}" in result.stdout
    assert "done: 4 optimizer steps" in result.stdout  # 2 epochs of 8 images in batches of 4
    assert {"step_000002.png", "step_000004.png"} <= set(os.listdir(out / "samples"))  # every epoch
    assert os.listdir(out) and sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-4"]
    from diffusers import DDPMPipeline
    pipeline = DDPMPipeline.from_pretrained(str(out))
    assert pipeline.unet.config.in_channels == 3
    images = pipeline(batch_size=1, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 16, 16, 3)
