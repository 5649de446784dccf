"""models.follow_data: with no model chosen, the UNet and its optimization follow the data; every
value the user set (a flag or the --config recipe) wins."""
import pytest
import yaml
from helpers import run_cli, save_random_images

from diffusion_extras.training import models
from diffusion_extras.training.config import DIGITS_UNET, TrainConfig, parse_config

DIGITS_OPTIMIZATION = {name: getattr(TrainConfig(), name) for name in models.DIFFUSERS_RECIPE}


def test_the_embedded_digits_keep_the_digits_recipe():
    choice = models.follow_data(parse_config([]), 1)
    assert choice.model == DIGITS_UNET and choice.settings == {} and choice.optimization == ""
    assert DIGITS_OPTIMIZATION["learning_rate"] == 2e-3 and DIGITS_OPTIMIZATION["max_train_steps"] == 1200


@pytest.mark.parametrize("resolution", [32, 64])
def test_an_rgb_folder_trains_diffusers_unet_with_diffusers_recipe(tmp_path, resolution):
    choice = models.follow_data(parse_config(["--train_data_dir", str(tmp_path), "--resolution", str(resolution)]), 3)
    assert choice.model == {**models.DIFFUSERS_DEFAULT_UNET, "in_channels": 3, "out_channels": 3}
    # train_unconditional.py's argparse defaults, looked up in its source
    assert choice.settings == dict(learning_rate=1e-4, lr_scheduler="cosine", lr_warmup_steps=500, adam_beta1=0.95,
                                   adam_beta2=0.999, adam_weight_decay=1e-6, adam_epsilon=1e-8, ema_max_decay=0.9999,
                                   ema_inv_gamma=1.0, ema_power=0.75, num_epochs=100, max_train_steps=None)
    assert "diffusers' train_unconditional.py recipe (learning_rate 0.0001, lr_scheduler cosine, " \
           "lr_warmup_steps 500" in choice.optimization and "steps from the epochs" in choice.optimization


def test_a_grayscale_folder_follows_too_and_keeps_the_digits_recipe_below_32_px(tmp_path):
    at_32 = models.follow_data(parse_config(["--train_data_dir", str(tmp_path), "--resolution", "32"]), 1)
    assert at_32.model["in_channels"] == 1 and at_32.model["block_out_channels"] == [128, 128, 256, 256, 512, 512]
    assert at_32.settings["learning_rate"] == 1e-4
    # at 16 px the model is the digits shape: the digits optimization is the one tuned for it
    at_16 = models.follow_data(parse_config(["--train_data_dir", str(tmp_path), "--resolution", "16"]), 1)
    assert at_16.model == DIGITS_UNET and at_16.settings == {} and at_16.optimization == ""


def test_a_value_the_user_set_wins_by_flag_or_recipe(tmp_path):
    flag = models.follow_data(parse_config(["--train_data_dir", str(tmp_path), "--resolution", "32",
                                            "--learning_rate", "2e-3", "--max_train_steps", "7"]), 3)
    assert "learning_rate" not in flag.settings and "max_train_steps" not in flag.settings  # 2e-3 is also our default
    assert flag.settings["lr_warmup_steps"] == 500
    assert "yours kept: --learning_rate, --max_train_steps" in flag.optimization
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"adam_beta1": 0.9, "num_epochs": 3}))
    from_recipe = models.follow_data(parse_config(["--config", str(recipe), "--train_data_dir", str(tmp_path),
                                                   "--resolution", "32"]), 3)
    assert {"adam_beta1", "num_epochs", "max_train_steps"}.isdisjoint(from_recipe.settings)
    assert from_recipe.settings["learning_rate"] == 1e-4
    # all of it given: nothing is taken and the line says nothing about the optimization
    every = [arg for name, value in DIGITS_OPTIMIZATION.items() if value is not None
             for arg in (f"--{name}", str(value))]
    assert models.follow_data(parse_config(["--train_data_dir", str(tmp_path), "--resolution", "32", *every]),
                              3).optimization == ""


def test_the_followed_recipe_is_announced_and_lands_in_training_config_yaml(tmp_path):
    """No --config: train_ddpm.py on an RGB folder at 32 px trains diffusers' UNet with its recipe;
    the model line says so, and training_config.yaml records the values the run used."""
    folder, out = save_random_images(tmp_path / "images", 2, 32, 32), tmp_path / "run"
    result = run_cli(["train_ddpm.py", "--train_data_dir", folder, "--resolution", 32, "--output_dir", out,
                      "--train_batch_size", 2, "--num_epochs", 1, "--eval_batch_size", 1,
                      "--ddpm_num_inference_steps", 1, "--logger", "none"])
    model_line = next(line for line in result.stdout.splitlines() if line.startswith("model: "))
    assert "113.7M parameters; optimization: diffusers' train_unconditional.py recipe (learning_rate 0.0001" \
        in model_line and "yours kept: --num_epochs" in model_line
    saved = yaml.safe_load((out / "training_config.yaml").read_text())
    assert {k: saved[k] for k in ("learning_rate", "lr_scheduler", "lr_warmup_steps", "adam_beta1", "adam_weight_decay",
                                  "ema_max_decay", "ema_power", "ema_inv_gamma", "num_epochs", "max_train_steps",
                                  "train_batch_size")} == dict(
        learning_rate=1e-4, lr_scheduler="cosine", lr_warmup_steps=500, adam_beta1=0.95, adam_weight_decay=1e-6,
        ema_max_decay=0.9999, ema_power=0.75, ema_inv_gamma=1.0, num_epochs=1, max_train_steps=1, train_batch_size=2)
