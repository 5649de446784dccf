"""End-to-end tests of `python train_ddpm.py` on a tiny UNet and the embedded digits."""
import math
import os

import numpy as np
import pytest
import torch
from helpers import load_unet_weights, read_history, run_training
from PIL import Image
from safetensors.torch import load_file


def test_short_run_saves_loadable_pipeline_samples_and_config(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    result = run_training(tiny_recipe(save_images_steps=3), out, "--max_train_steps", 4)
    assert "done: 4 optimizer steps" in result.stdout
    from diffusers import DDPMPipeline
    pipeline = DDPMPipeline.from_pretrained(str(out))
    images = pipeline(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                      output_type="np").images
    assert images.shape == (2, 8, 8, 1) and 0 <= images.min() and images.max() <= 1
    # a grid at step 3 and at the end, 4 images of 8 px in a 2x2 grid with 2 px padding
    for step in (3, 4):
        grid = Image.open(out / "samples" / f"step_{step:06d}.png")
        assert grid.size == (2 * 8 + 3 * 2, 2 * 8 + 3 * 2)
    history = read_history(out)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all(math.isfinite(h["loss"]) and h["images_per_second"] > 0 for h in history)
    # per-timestep diagnostics: each step's 8 samples land in the bins; all counters present
    assert all(any(k.startswith("loss_bin/") for k in h) and {"grad_norm", "clip_rate", "nonfinite_steps"} <= set(h)
               for h in history)
    import json
    report = json.loads((out / "training_report.json").read_text())
    assert report["summary"]["steps_run"] == 4 and report["bayes_optimal_bins"]
    assert "## Findings" in (out / "training_report.md").read_text()
    with Image.open(out / "images" / "loss_per_timestep.png") as plot:
        assert plot.size == (700, 450)
    import yaml
    saved = yaml.safe_load((out / "training_config.yaml").read_text())
    assert saved["max_train_steps"] == 4 and saved["resolution"] == 8
    # the exported pipeline holds weights and scheduler config only, never optimizer state
    files = {os.path.relpath(os.path.join(r, f), out / "unet") for r, _, fs in os.walk(out / "unet") for f in fs}
    assert files == {"config.json", "diffusion_pytorch_model.safetensors"}


def test_exported_pipeline_holds_ema_weights_not_training_weights(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(checkpointing_steps=5, ema_max_decay=0.9), out, "--max_train_steps", 5)
    exported = load_unet_weights(out)
    training = load_file(out / "checkpoint-5" / "model.safetensors")
    ema_state = torch.load(out / "checkpoint-5" / "custom_checkpoint_1.pkl", weights_only=True)
    from diffusers import UNet2DModel
    names = [n for n, _ in UNet2DModel.from_pretrained(str(out / "unet")).named_parameters()]  # EMA order
    assert set(names) == set(exported) == set(training)
    differs = [n for n in names if not torch.equal(training[n], exported[n])]
    assert differs, "the pipeline should carry EMA weights, which differ from the training weights"
    for name, shadow in zip(names, ema_state["shadow_params"]):
        assert torch.equal(exported[name], shadow), name


@pytest.mark.parametrize("accumulation", [1, 2])
def test_lr_schedule_per_optimizer_step(tiny_recipe, tmp_path, accumulation):
    """Warmup then cosine, counted in optimizer steps whatever the accumulation (diffusers' example
    scripts scale the schedule by the accumulation or the process count, which stretches it)."""
    out = tmp_path / "run"
    run_training(tiny_recipe(), out, "--max_train_steps", 10, "--lr_warmup_steps", 4,
                 "--gradient_accumulation_steps", accumulation, "--learning_rate", 1e-3)
    lrs = {h["step"]: h["lr"] for h in read_history(out)}
    # the lr a step used: step s runs with the schedule's value after s-1 scheduler steps
    def expected(s):
        k = s - 1
        if k < 4:
            return 1e-3 * k / 4
        return 1e-3 * 0.5 * (1 + math.cos(math.pi * (k - 4) / (10 - 4)))
    for step in (1, 2, 4, 5, 7, 10):
        assert lrs[step] == pytest.approx(expected(step), rel=1e-9, abs=1e-15), step


def test_same_seed_same_numbers(tiny_recipe, tmp_path, tiny_reference_run):
    # a: the shared 3-step run of the tiny recipe (seed 0, the default); b gives --seed 0 itself
    a, b, c = tiny_reference_run, tmp_path / "b", tmp_path / "c"
    for out, seed in ((b, 0), (c, 4)):
        run_training(tiny_recipe(), out, "--max_train_steps", 3, "--seed", seed)
    losses = [[h["loss"] for h in read_history(o)] for o in (a, b, c)]
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]
    wa, wb = load_unet_weights(a), load_unet_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("flags,message", [
    (["--train_batch_size", "0"], "--train_batch_size must be at least 1"),
    (["--learning_rate=-1e-4"], "--learning_rate must be positive"),
    (["--learning_rate", "-1e-4"], "write negative numbers as --flag=-1e-4"),
    (["--train_batch_size", "four"], "argument --train_batch_size: invalid int value: 'four'"),
    (["--resolution", "9"], "--resolution 9 cannot be halved 1 times"),
    (["--mixed_precision", "fp16"], "--mixed_precision fp16 needs a CUDA GPU"),
    (["--train_data_dir", "/nonexistent/images"], "--train_data_dir /nonexistent/images: no such folder"),
    (["--dataset_name", "./no/such/folder"], "./no/such/folder: no such folder"),
    (["--resume_from_checkpoint", "/nonexistent/checkpoint-5"], "no such checkpoint folder"),
])
def test_bad_input_is_one_line_error_before_training(tiny_recipe, tmp_path, flags, message):
    if "fp16" in flags and torch.cuda.is_available():
        pytest.skip("a GPU is present: fp16 is valid here")
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2, *flags, check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run" / "model_index.json").exists()


def test_output_dir_that_is_a_file(tiny_recipe, tmp_path):
    target = tmp_path / "taken"
    target.write_text("precious")
    result = run_training(tiny_recipe(), target, "--max_train_steps", 2, check=False)
    assert result.returncode == 2 and "is a file" in result.stderr and "Traceback" not in result.stderr
    assert target.read_text() == "precious"


def test_dataset_without_image_column(tiny_recipe, tmp_path):
    import datasets
    datasets.Dataset.from_dict({"label": [1, 2, 3]}).save_to_disk(str(tmp_path / "labels"))
    result = run_training(tiny_recipe(), tmp_path / "run", "--dataset_name", tmp_path / "labels", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no image column (columns: label)" in result.stderr and "--image_column" in result.stderr


def test_fresh_run_refuses_output_dir_with_checkpoints(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 2)
    before = (out / "checkpoint-2" / "model.safetensors").read_bytes()
    result = run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 4, check=False)
    assert result.returncode == 2 and "already holds checkpoint-2" in result.stderr
    assert (out / "checkpoint-2" / "model.safetensors").read_bytes() == before


def test_bf16_autocast_keeps_noising_and_loss_fp32(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(), out, "--max_train_steps", 3, "--mixed_precision", "bf16")
    history = read_history(out)
    assert all(math.isfinite(h["loss"]) for h in history)
    weights = load_unet_weights(out)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_image_folder_with_corrupt_file_trains_and_names_it(tiny_recipe, tmp_path):
    from PIL import Image
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(20):
        Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    result = run_training(tiny_recipe(max_train_samples=None, train_batch_size=4), tmp_path / "run",
                          "--train_data_dir", folder, "--max_train_steps", 2, "--random_flip", "--no-center_crop")
    assert "broken.png" in result.stderr and "skipping unreadable image" in result.stderr


def test_find_lr_sweeps_and_suggests_without_training_outputs(tiny_recipe, tmp_path):
    out = tmp_path / "lr"
    result = run_training(tiny_recipe(), out, "--find_lr", "--find_lr_steps", 40)
    import json
    sweep = json.loads((out / "lr_finder.json").read_text())
    assert sweep["lr"][0] == pytest.approx(1e-7)
    assert all(b > a for a, b in zip(sweep["lr"], sweep["lr"][1:]))
    assert 10 <= len(sweep["lr"]) <= 40
    assert "LR range test over" in result.stdout and (out / "lr_finder.png").exists()
    assert not (out / "model_index.json").exists() and not list(out.glob("checkpoint-*"))
