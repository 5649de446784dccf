"""What the run does at intervals and at the end (training/periodic.py): the sample grids' DDIM
steps follow the run's length unless given, and the lines that announce them say what they cost."""
import re

import pytest
import yaml
from helpers import TINY_RECIPE, run_training

from diffusion_extras.evaluation import sampling
from diffusion_extras.training.periodic import grid_inference_steps, grid_line


@pytest.mark.parametrize("max_train_steps, steps", [(20, 10), (1, 10), (200, 20), (499, 49), (500, 50), (1200, 50)])
def test_a_short_runs_grids_take_fewer_ddim_steps_unless_given(max_train_steps, steps):
    assert grid_inference_steps(50, False, max_train_steps) == steps
    assert grid_inference_steps(50, True, max_train_steps) == 50  # --ddpm_num_inference_steps, or a recipe's
    assert grid_inference_steps(4, False, max_train_steps) == 4  # never more than configured


def test_the_grids_line_says_its_steps_and_its_estimated_cost():
    # 64 images x 10 steps at 0.02 s a training image, half of that a pass: 6.4 s; guidance doubles the passes
    assert grid_line("64 images", 64, 10, 1.0, 0.02) == \
        "final sample grid (64 images, 10 DDIM steps, about 6.4 s at the training speed)"
    assert grid_line("64 images", 64, 10, 2.0, 0.02) == \
        "final sample grid (64 images, 10 DDIM steps, about 13 s at the training speed)"
    assert grid_line("conditions of 16 images", 16, 3, 1.0, None) == \
        "final sample grid (conditions of 16 images, 3 DDIM steps)"  # no speed measured yet


@pytest.mark.parametrize("given", [False, True])
def test_a_runs_grids_and_debug_images_sample_the_steps_their_line_says(tmp_path, monkeypatch, given):
    """A 3-step run without --ddpm_num_inference_steps samples its grid and debug images with 10
    DDIM steps (7 given) and announces each with its estimate, then its time."""
    steps_used = []
    generate = sampling.generate
    monkeypatch.setattr(sampling, "generate", lambda *args, **kwargs: steps_used.append(args[3]) or
                        generate(*args, **kwargs))
    recipe = {key: value for key, value in TINY_RECIPE.items() if key != "ddpm_num_inference_steps"}
    recipe.update(save_images_steps=3, eval_batch_size=4)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    flags = ["--ddpm_num_inference_steps", "7"] if given else []
    result = run_training(path, tmp_path / "run", "--max_train_steps", 3, *flags)
    steps = 7 if given else 10
    assert len(steps_used) == 4 and set(steps_used) == {steps}  # the grid's 2 rows; the debug images' raw and EMA
    for line in (rf"final sample grid \(4 images, {steps} DDIM steps, about \d+\.\d s at the training speed\)",
                 rf"final debug images and loss plot \(12 images, {steps} DDIM steps, about \d+\.\d s at the training "
                 r"speed\)"):
        assert re.search("^" + line + r" \.\.\.$", result.stdout, re.MULTILINE), result.stdout[-2000:]
        assert re.search("^" + line + r": done in \d+\.\d s$", result.stdout, re.MULTILINE)
