"""Memory and speed switches on CPU: each must train and change nothing it should not."""


import pytest
import torch
from helpers import read_history, run_training, tiny_run


def losses(recipe, tmp_path, name, *flags):
    out = tmp_path / name
    run_training(recipe, out, "--max_train_steps", 3, *flags)
    return [h["loss"] for h in read_history(out)]


@pytest.fixture
def default_losses(tiny_reference_run):
    """The losses of the tiny recipe's 3-step run without a switch (conftest.tiny_reference_run:
    trained once per session, not once per test): every switch's reference."""
    return [h["loss"] for h in read_history(tiny_reference_run)]


@pytest.mark.parametrize("flag", ["--gradient_checkpointing", "--channels_last"])
def test_switch_trains_like_the_default(tiny_recipe, tmp_path, default_losses, flag):
    """Recomputation and memory layout give the default run's numbers."""
    reference = default_losses
    switched = losses(tiny_recipe(), tmp_path, "switched", flag)
    assert switched == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("flags, expected", [((), False), (("--allow_tf32",), True)])
def test_allow_tf32_sets_the_tf32_switches_of_matmuls_and_convolutions(tmp_path, fresh_accelerate, flags, expected):
    """TF32 is a no-op on CPU, so a CPU run's numbers cannot show it: check instead that the flag
    reaches the two switches torch reads on an Ampere+ GPU, and that without it they are left alone."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        tiny_run(tmp_path, *flags, "--max_train_steps", 1)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (expected, expected)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_8bit_adam_without_bitsandbytes_is_refused(tiny_recipe, tmp_path):
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed here")
    except ImportError:
        pass
    result = run_training(tiny_recipe(), tmp_path / "run", "--use_8bit_adam", check=False)
    assert result.returncode == 2 and "pip install bitsandbytes" in result.stderr


def test_compile_mode_is_validated(tiny_recipe, tmp_path):
    result = run_training(tiny_recipe(), tmp_path / "run", "--torch_compile_mode", "fastest", check=False)
    assert result.returncode == 2 and "--torch_compile_mode 'fastest' is not one of" in result.stderr
