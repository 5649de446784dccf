"""Shared fixtures: a tiny UNet recipe and a runner for the real command line."""
import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# 8 px grayscale, two levels, ~20k parameters: a CPU step takes milliseconds.
TINY_RECIPE = {
    "resolution": 8, "train_batch_size": 8, "eval_batch_size": 4, "ddpm_num_inference_steps": 2,
    "diagnostics_steps": 1, "save_images_steps": 1000, "save_model_steps": 1000, "checkpointing_steps": 1000,
    "logger": "none", "max_train_samples": 64, "learning_rate": 1e-3, "lr_warmup_steps": 2,
    "validation_split": 0.0, "grad_diagnostics_steps": 0,  # the digits default's held-out and gradient probes: off
    "model": {"in_channels": 1, "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
              "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"],
              "norm_num_groups": 4, "dropout": 0.0},
}


@pytest.fixture
def tiny_recipe(tmp_path):
    def write(**overrides):
        values = {**TINY_RECIPE, **overrides}
        path = tmp_path / f"tiny-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
        path.write_text(yaml.safe_dump(values))
        return str(path)
    return write


def cli_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", HF_HOME=str(tmp_path / "hf_home"),
               HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"), PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture
def run_cli(tmp_path):
    """Run a command in a fresh interpreter from the project root; returns CompletedProcess."""
    def run(args, launcher=None, env=None, timeout=300, check=False):
        command = (launcher or [sys.executable]) + args
        merged = {k: v for k, v in {**cli_env(tmp_path), **(env or {})}.items() if v is not None}  # None unsets
        result = subprocess.run(command, cwd=ROOT, env=merged,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result
    return run


def read_history(output_dir) -> list:
    with open(os.path.join(output_dir, "logs", "history.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_unet_weights(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "unet", "diffusion_pytorch_model.safetensors"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); run them with `pytest -m cuda`")
