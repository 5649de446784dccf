"""Shared fixtures: a tiny UNet recipe and model; the commands run in this process through their
main() (run_main: exit code, stdout and stderr), and in processes of their own where a process is
what a test asks about (run_command: signals, kills, several ranks, launchers, import-time state)."""
import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import yaml
from processes import ROOT, checked, launch_training

# 8 px grayscale, two levels, ~20k parameters: a CPU step takes milliseconds. No sample grid, debug
# images or loss plot (save_images_steps 0), which were ~40% of a 3-step command's CPU time: the
# tests of those ask for them.
TINY_RECIPE = {
    "resolution": 8, "train_batch_size": 8, "eval_batch_size": 4, "ddpm_num_inference_steps": 2,
    "diagnostics_steps": 1, "save_images_steps": 0, "save_model_steps": 1000, "checkpointing_steps": 1000,
    "logger": "none", "max_train_samples": 64, "learning_rate": 1e-3, "lr_warmup_steps": 2,
    "validation_split": 0.0, "grad_diagnostics_steps": 0,  # the digits default's held-out and gradient probes: off
    "model": {"in_channels": 1, "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
              "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"],
              "norm_num_groups": 4, "dropout": 0.0},
}


def write_tiny_recipe(folder, **overrides) -> str:
    """TINY_RECIPE with `overrides` as a YAML file in `folder` (named by its content); returns its path."""
    values = {**TINY_RECIPE, **overrides}
    path = os.path.join(folder, f"tiny-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh)
    return path


@pytest.fixture
def tiny_recipe(tmp_path):
    """tiny_recipe(**overrides): write_tiny_recipe in this test's folder."""
    return lambda **overrides: write_tiny_recipe(tmp_path, **overrides)


def save_random_images(folder, count: int, height: int, width: int, seed: int = 0) -> str:
    """`count` random RGB PNGs 0.png, 1.png, ... in `folder` (created); returns the folder."""
    import numpy as np
    from PIL import Image
    os.makedirs(folder, exist_ok=True)
    for index, image in enumerate(np.random.default_rng(seed).integers(0, 256, (count, height, width, 3),
                                                                        dtype=np.uint8)):
        Image.fromarray(image).save(os.path.join(folder, f"{index}.png"))
    return str(folder)


# Variables of the caller's shell that change what the libraries do (offline mode, endpoint, cache
# folders, the tracker's mode, an accelerate config): no test may depend on them.
CALLER_VARIABLES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "WANDB_", "ACCELERATE_")
READ_AT_IMPORT = ("huggingface_hub", "datasets", "diffusers", "transformers", "accelerate", "wandb")


def pytest_configure(config):
    """Every test runs as in a clean shell, whatever the caller exported (HF_HUB_OFFLINE=1, a custom
    HF_HOME or HF_ENDPOINT, WANDB_MODE, ...): those variables are removed before any library reads
    them (huggingface_hub and datasets read them once, at import), and HF_HOME is a folder of this
    session. A test that needs offline mode or an endpoint sets it itself, in a process of its own."""
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); run them with `pytest -m cuda`")
    imported = sorted(name for name in sys.modules if name.split(".")[0] in READ_AT_IMPORT)
    if imported:
        raise pytest.UsageError(f"{imported[0]} was imported before the tests cleared the caller's HF_*/WANDB_* "
                                "variables (by a pytest plugin?); run pytest with -p no:<that plugin>")
    for name in list(os.environ):
        if name.startswith(CALLER_VARIABLES):
            del os.environ[name]
    # torch on one intra-op thread in every test process and command: pytest -n 3 on 2 cores runs three
    # tests at once, and a thread per core each would have them wait on each other. Also the summation
    # order that tests which recompute a command's numbers rely on.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["WANDB_MODE"] = "offline"  # a run with --logger wandb logs locally, in-process and in commands
    config.hf_home = os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="ddpm-tests-hf-home-")


def pytest_unconfigure(config):
    if getattr(config, "hf_home", None):
        shutil.rmtree(config.hf_home, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests that read one module-scoped fixture of their module (most are a training run made once
    and read by several tests) run on one xdist worker, so that it is made once, not once per worker."""
    for item in items:
        for name in item.fixturenames:
            definitions = item._fixtureinfo.name2fixturedefs.get(name)
            if (definitions and definitions[-1].scope == "module"
                    and definitions[-1].func.__module__ == item.module.__name__):
                item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{name}"))
                break


# ----------------------------------------------------------------------------- in this process
def run_main(main, argv, *extra, env=None, merge_stderr=False):
    """`main(argv, *extra)` (a command's main: the trainer's takes hooks) in this process, as its
    command line would run: a CompletedProcess with the exit code it returned (or exited with) and
    what it printed. `env`: variables set for the call (None unsets), for those read while it runs.
    Warnings print to its stderr, once per place per call, as in a fresh process. merge_stderr:
    stderr into stdout in the order written (`2>&1`); the result's stderr is then ""."""
    argv = [str(arg) for arg in argv]
    out = io.StringIO()
    err = out if merge_stderr else io.StringIO()
    with (contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(),
          environment(env or {})):
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        try:
            code = main(argv, *extra)
        except SystemExit as exit_:  # argparse's --help and usage errors
            code = exit_.code
    if isinstance(code, str):  # sys.exit("message") prints it and exits 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), "" if merge_stderr else err.getvalue())


@contextlib.contextmanager
def environment(values: dict):
    """os.environ with `values` set (None unsets) while it lasts, then as it was."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, str(value))
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def command_main(name: str):
    """The main() of a command: "train_ddpm.py" or a module run with -m ("diffusion_extras.sample")."""
    import importlib
    mains = {"train_ddpm.py": "diffusion_extras.training.main",
             "diffusion_extras.sample": "diffusion_extras.cli.sample",
             "diffusion_extras.evaluate": "diffusion_extras.cli.evaluate",
             "diffusion_extras.posthoc_ema": "diffusion_extras.cli.posthoc_ema",
             "diffusion_extras.report": "diffusion_extras.report.health"}
    return importlib.import_module(mains[name]).main


def run_cli_in_process(args, env=None, check=False, merge_stderr=False):
    """`python ARGS` (train_ddpm.py or -m one of the package's commands) through its main() in this
    process (run_main); check: a non-zero exit fails the test."""
    args = [str(arg) for arg in args]
    name, argv = (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
    result = run_main(command_main(name), argv, env=env, merge_stderr=merge_stderr)
    return checked(result, " ".join(args), check)


@pytest.fixture
def run_cli():
    """run_cli(args, env=None, check=False, merge_stderr=False): a command line run in this process
    (run_cli_in_process)."""
    return run_cli_in_process


def run_training(recipe, output_dir, *flags, hooks=None, env=None, check=True):
    """The trainer on a recipe in this process: `train_ddpm.py --config RECIPE --output_dir OUTPUT_DIR
    FLAGS` through training.main.main with `hooks` (tests/faults.py makes them); a CompletedProcess.
    A non-zero exit fails the test unless check=False (for tests of a refusal)."""
    from diffusion_extras.training.main import main
    result = run_main(main, ["--config", recipe, "--output_dir", output_dir, *flags], hooks, env=env)
    return checked(result, "training", check)


@pytest.fixture
def train():
    """train(recipe, output_dir, *flags, hooks=None, env=None, check=True): run_training."""
    return run_training


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory):
    """The output folder of the tiny recipe trained 3 steps (seed 0, no other flag), trained once per
    session (per xdist worker) for the tests that compare a run with it. Read it, never write it."""
    folder = tmp_path_factory.mktemp("tiny_reference_run")
    run_training(write_tiny_recipe(folder), folder / "run", "--max_train_steps", 3)
    return folder / "run"


@pytest.fixture
def launch(tmp_path):
    """launch(recipe, output_dir, *flags, faults=(), ranks=1, launcher=None, env=None, check=True):
    launch_training with this test's folder for what the processes download."""
    return functools.partial(launch_training, tmp_path)


@pytest.fixture
def parquet_images(tmp_path):
    """40 grey images of 10x12 whose pixel value is their row index, in 4 parquet shards."""
    import datasets
    import numpy as np
    from PIL import Image
    folder = tmp_path / "pq"
    folder.mkdir()
    images = [Image.fromarray(np.full((10, 12), i * 5, np.uint8)) for i in range(40)]
    features = datasets.Features({"img": datasets.Image(), "n": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict({"img": images, "n": list(range(40))}, features=features)
    for k in range(4):
        dataset.shard(4, k).to_parquet(str(folder / f"part-{k}.parquet"))
    return str(folder)


@pytest.fixture
def fresh_accelerate():
    """Each in-process run gets its own accelerate state (it is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True), GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True), GradientState._reset_state()


def tiny_run(tmp_path, *flags, hooks=None, output_dir=None, **recipe):
    """An in-process run set up (training.build.setup) from TINY_RECIPE with `recipe` overrides and
    `flags`, in `output_dir` (default tmp_path/run), with `hooks` (training.hooks.Hooks); use with
    the fresh_accelerate fixture."""
    from diffusion_extras.training import build
    from diffusion_extras.training.config import parse_config
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **recipe}))
    return build.setup(parse_config(["--config", str(path), "--output_dir", str(output_dir or tmp_path / "run"),
                                     *map(str, flags)]), hooks)


def tiny_unet(channels: int = 1, sample_size: int = TINY_RECIPE["resolution"], seed: int = 0, **overrides):
    """The TINY_RECIPE UNet as a diffusers model (initialised from torch.manual_seed(seed)), for
    tests that need one without a training run; keyword arguments override its architecture."""
    import torch
    from diffusers import UNet2DModel
    torch.manual_seed(seed)
    architecture = {**TINY_RECIPE["model"], "in_channels": channels, "out_channels": channels, **overrides}
    return UNet2DModel(sample_size=sample_size, **architecture)


def save_tiny_pipeline(path, channels: int = 1) -> str:
    """A tiny_unet DDPMPipeline saved like a training output folder, with the files training
    leaves beside it (a checkpoint, samples, a model card) that loading must ignore."""
    from diffusers import DDPMPipeline, DDPMScheduler
    pipeline = DDPMPipeline(unet=tiny_unet(channels=channels), scheduler=DDPMScheduler(num_train_timesteps=100))
    pipeline.save_pretrained(path)
    os.makedirs(os.path.join(path, "checkpoint-10"))
    os.makedirs(os.path.join(path, "samples"))
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("model card")
    return str(path)


def read_history(output_dir) -> list:
    with open(os.path.join(output_dir, "logs", "history.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_unet_weights(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "unet", "diffusion_pytorch_model.safetensors"))


def load_bench_module(name: str):
    """bench/<name>.py as a module (bench/ holds scripts, not a package), loaded once."""
    import importlib.util
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


