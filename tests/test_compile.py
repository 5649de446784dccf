"""--torch_compile stays compiled: graphs, graph breaks and recompiles counted.

A graph break or a recompile costs nothing visible on CPU and the whole speed-up on a GPU, so the
tallies of torch._dynamo (faults.dynamo_counts) are asserted instead: no break, and no graph
captured after warm-up (the first steps and the first of each periodic extra), through logging
windows, checkpoints, grids, FID, held-out losses, the gradient monitor, a resume and 2 ranks.

Most runs use --torch_compile_backend eager: dynamo captures the same graphs (and breaks and
recompiles at the same places) as with inductor, without generating code, so counting is cheap.
One test keeps inductor end to end and compares its losses with an eager run.
"""
import shutil

import numpy as np
import pytest
import torch
from faults import dynamo_counts, read_shares
from helpers import TINY_RECIPE, read_history, tiny_run, write_tiny_recipe
from processes import launch_training

from diffusion_extras.training import loop
from diffusion_extras.training.hooks import Hooks

STEPS = 6
# Every periodic extra at step 2 (warm-up), again at 4 and at the end; checkpoints at 2, 4, 6. A
# constant LR after warmup, so that a resumed run of another length takes the same steps.
EXTRAS = dict(validation_split=0.25, validation_steps=2, grad_diagnostics_steps=2, save_images_steps=2,
              checkpointing_steps=2, save_model_steps=4, lr_scheduler="constant_with_warmup")
FLAGS = ("--use_ema", "--snr_gamma", 5, "--gradient_accumulation_steps", 2, "--eval_steps", 2,
         "--feature_extractor", "tiny", "--eval_num_samples", 4)
CHEAP_COMPILE = ("--torch_compile", "--torch_compile_backend", "eager")
# The tiny recipe's blocks at one level (no down- or upsampling), its mid-block attention kept: less
# for dynamo to trace and for inductor to compile. Inductor compiles a kernel per fused op and shape:
# at one level a fresh machine compiles about half as many C++ kernels, and the inductor test takes
# about half the CPU time with a cold cache. The runs whose subject acts outside the UNet (a
# prediction type, a second rank) use it too; the run with every extra and its resumes count graphs
# on both levels.
ONE_LEVEL = {**TINY_RECIPE["model"], "block_out_channels": [8], "down_block_types": ["DownBlock2D"],
             "up_block_types": ["UpBlock2D"]}
# Each prediction type with a precision and a layout. The prediction type acts outside the UNet
# (targets, min-SNR weights), so one run has every extra (in bf16 autocast, channels_last) and the
# other two train and sample the FID and the final grid only, at ONE_LEVEL (they pay no second
# capture for the gradient monitor's eval mode).
FINAL_GRID = {"save_images_steps": 1000}
SETTINGS = {"epsilon": (("--mixed_precision", "bf16", "--channels_last"), EXTRAS),
            "v_prediction": ((), {**FINAL_GRID, "model": ONE_LEVEL}),
            "sample": (("--channels_last",), {**FINAL_GRID, "model": ONE_LEVEL})}
STEP_GRAPHS = 5  # an optimizer step's graphs with accumulation 2 (see the test below)
WARM = 3  # counts after step 3 include step 2's extras: the last first-time graph


def fresh_state():
    """A clean accelerate singleton and dynamo cache, with zeroed counters: each run counts its own graphs."""
    from accelerate.state import AcceleratorState, GradientState
    from torch._dynamo.utils import counters
    AcceleratorState._reset_state(True), GradientState._reset_state()
    torch._dynamo.reset()
    counters.clear()


def counted_run(folder, *flags, output_dir=None, **recipe) -> dict:
    """Train in process, recording dynamo_counts() after each step ({step: counts}) and at the end ("end")."""
    counts = {}
    fresh_state()
    run = tiny_run(folder, *flags, hooks=Hooks(after_step=lambda run: counts.update(
        {run.progress.global_step: dynamo_counts()})), output_dir=output_dir, **recipe)
    loop.train(run)
    counts["end"] = dynamo_counts()
    fresh_state()
    return counts


def losses_by_step(output_dir) -> dict:
    """{step: logged loss}; a resumed run's later lines win."""
    return {h["step"]: h["loss"] for h in read_history(output_dir) if "loss" in h}


def assert_stays_compiled(counts: dict, warm: int = WARM, until="end") -> None:
    """No break; the graphs after step `warm` are all there are at `until` (a step, or "end": after
    the end-of-run grids, evaluation and export)."""
    assert counts["end"]["breaks"] == 0, counts
    assert counts[warm]["graphs"] >= 1, "nothing was compiled"
    assert counts[until] == counts[warm], f"graphs captured after warm-up (step {warm}): {counts}"


@pytest.fixture(scope="module", params=list(SETTINGS))
def compiled_run(request, tmp_path_factory):
    """(prediction type, output folder, counts) of a 6-step compiled run with every extra."""
    prediction_type = request.param
    folder = tmp_path_factory.mktemp(f"compiled-{prediction_type}")
    flags, extras = SETTINGS[prediction_type]
    counts = counted_run(folder, *CHEAP_COMPILE, *FLAGS, *flags, "--max_train_steps", STEPS,
                         "--prediction_type", prediction_type, **extras)
    return prediction_type, folder / "run", counts


@pytest.mark.xdist_group("test_compile.compiled_run")
def test_training_stays_compiled_with_every_extra(compiled_run):
    """Per prediction type (min-SNR weights differ per type), with accumulation 2 (no_sync on the first
    micro-batch), channels_last and bf16 autocast: no break, and no graph after warm-up but the one
    named at the end. Every run
    has the step's five graphs (the forward with its loss; two backwards through compiled autograd,
    the first micro-batch's making the gradients and the second's adding to them; the clipping;
    the EMA with the step's diagnostics) and the sampling copy's no-grad graph of FID and the grids
    (one timestep per call); the run with the other extras adds three: the training UNet in eval mode
    (the gradient monitor's probe), the copy's graph of held-out losses (one timestep per image,
    over batch sizes made dynamic), and a capture of the copy for the grid's rows (2 images, a
    batch size FID does not use). The copy's forward is its own frame since the training UNet's is
    traced inside the step's loss: its batch size is static until a second size recompiles it with a
    dynamic one (dynamo's automatic dynamic shapes), so the two runs whose first grid is the final
    one capture that graph after their last step, in the end-of-run grid."""
    prediction_type, _, counts = compiled_run
    every_extra = SETTINGS[prediction_type][1] is EXTRAS
    assert_stays_compiled(counts, until="end" if every_extra else STEPS)
    assert counts[1]["graphs"] == STEP_GRAPHS, counts
    assert counts["end"]["graphs"] == STEP_GRAPHS + (4 if every_extra else 2), counts


def checkpoint_layout(checkpoint) -> dict:
    """{file: its contents with each tensor as (shape, dtype) and each other leaf as its type}: what a
    resume loads by name, whatever values it holds."""
    import json

    from safetensors.torch import load_file

    def shape_of(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype
        if isinstance(value, dict):
            return {key: shape_of(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [shape_of(item) for item in value]
        return type(value).__name__
    layout = {}
    for path in sorted(checkpoint.iterdir()):
        if path.suffix == ".safetensors":
            layout[path.name] = shape_of(load_file(path))
        elif path.suffix == ".json":
            layout[path.name] = sorted(json.loads(path.read_text()))
        else:
            layout[path.name] = shape_of(torch.load(path, weights_only=False))
    return layout


@pytest.mark.xdist_group("test_compile.compiled_run")
@pytest.mark.parametrize("compiled_run", ["epsilon"], indirect=True)  # the checkpoint does not depend on the type
def test_a_compiled_checkpoint_resumes_eager_and_back(compiled_run, tmp_path):
    """Compiled to step 2, then eager from 2 to 4: its first loss (step 3: the checkpoint's weights) is
    the compiled run's to rounding, the eager backend running the captured forward op for op. Its
    later losses are not: the compiled backward (compiled autograd) sums the gradients of a tensor
    used twice (a skip connection) in another order than the autograd engine, and Adam turns those
    bf16 rounding differences into lr-sized ones. The eager run's checkpoint-4 has the compiled
    run's files, names, shapes and dtypes (no `_orig_mod.` prefix, the same optimizer and custom
    states), so a compiled run resumes it as it resumes its own: and the compiled run's checkpoint-4
    resumed compiled warms up again, keeps its graphs (counted) and repeats steps 5-6 bit for bit.
    The resumed legs leave out the periodic extras that change no weights (grids, FID, probes)."""
    prediction_type, reference, _ = compiled_run
    out, exact = tmp_path / "run", tmp_path / "exact"
    shutil.copytree(reference / "checkpoint-2", out / "checkpoint-2")
    shutil.copytree(reference / "checkpoint-4", exact / "checkpoint-4")
    settings = (*FLAGS, *SETTINGS[prediction_type][0], "--prediction_type", prediction_type,
                "--resume_from_checkpoint", "latest")
    no_extras = {**EXTRAS, "validation_steps": 1000, "grad_diagnostics_steps": 0, "save_images_steps": 1000,
                 "eval_steps": 1000}
    counted_run(tmp_path, *settings, "--max_train_steps", 4, output_dir=out, **no_extras)
    assert checkpoint_layout(out / "checkpoint-4") == checkpoint_layout(reference / "checkpoint-4")
    counts = counted_run(tmp_path, *CHEAP_COMPILE, *settings, "--max_train_steps", STEPS, output_dir=exact,
                         **no_extras)
    assert_stays_compiled(counts, warm=5, until=STEPS)  # the end-of-run extras are the copy's first
    resumed, straight, compiled_resume = losses_by_step(out), losses_by_step(reference), losses_by_step(exact)
    assert resumed[3] == pytest.approx(straight[3], rel=1e-6, abs=1e-7)
    assert np.isfinite(resumed[4]), resumed
    assert [compiled_resume[s] for s in (5, 6)] == [straight[s] for s in (5, 6)]


def test_two_ranks_stay_compiled_and_share_the_evaluation(tmp_path):
    """2 ranks (DDP, no_sync on the first micro-batch; the UNet at ONE_LEVEL), the gradient monitor on rank 0 only,
    checkpoints, grids and FID on both: each rank keeps its graphs after warm-up, with no break.
    The FID images are sampled on both ranks (12 images in batches of 4: ranks 0, 1, 0), and the
    last FID is bitwise the one-rank evaluation of the exported EMA weights; so is the last grid
    (2 rows of 2 images: one row a rank)."""
    import json

    import yaml
    from diffusers import UNet2DModel
    from PIL import Image

    from diffusion_extras.evaluation import metrics, sampling
    from diffusion_extras.training import artifacts
    out, counts_folder = tmp_path / "run", tmp_path / "counts"
    recipe = write_tiny_recipe(tmp_path, grad_diagnostics_steps=2, save_images_steps=2, checkpointing_steps=2,
                               model=ONE_LEVEL)
    launch_training(recipe, out, *CHEAP_COMPILE, "--use_ema", "--gradient_accumulation_steps", 2, "--max_train_steps",
                    4, "--eval_steps", 2, "--feature_extractor", "tiny", "--eval_num_samples", 12, ranks=2,
                    env={"ACCELERATE_USE_CPU": "1"},
                    faults=("--dynamo_counts", counts_folder, "--record_shares", tmp_path / "shares"))
    # at each of the 2 evaluations every rank sampled its own batches: rank 0 images 0-3 and 8-11, rank 1 4-7
    assert read_shares(tmp_path / "shares") == {0: [{"firsts": [0, 8], "images": 8}] * 2,
                                                1: [{"firsts": [4], "images": 4}] * 2}
    for rank in (0, 1):
        lines = [json.loads(line) for line in (counts_folder / f"rank{rank}.jsonl").read_text().splitlines()]
        assert_stays_compiled({line.pop("step"): line for line in lines})
    logged = {h["step"]: h for h in read_history(out) if "eval/fid" in h}
    assert sorted(logged) == [2, 4] and logged[4]["eval/num_samples"] == 12
    extractor = metrics.build_feature_extractor("tiny")
    reference = metrics.ReferenceStatistics.load(str(out / "logs" / "fid_reference_tiny.npz"))
    unet = UNet2DModel.from_pretrained(str(out / "unet"))
    scheduler = sampling.make_scheduler("ddim", json.loads((out / "scheduler" / "scheduler_config.json").read_text()))
    seed = yaml.safe_load((out / "training_config.yaml").read_text())["seed"]
    one_rank = metrics.evaluate_unet_metrics(unet, scheduler, [(extractor, reference, ["fid", "kid"])], 12,
                                             TINY_RECIPE["ddpm_num_inference_steps"], seed=seed,
                                             batch_size=TINY_RECIPE["eval_batch_size"])
    assert (logged[4]["eval/fid"], logged[4]["eval/kid"]) == (one_rank["fid"], one_rank["kid"])
    single = tmp_path / "one_rank_grid"
    artifacts.save_sample_grid(unet, None, scheduler, artifacts.Target(str(single), 4), TINY_RECIPE["eval_batch_size"],
                               TINY_RECIPE["ddpm_num_inference_steps"], seed=seed)
    grids = [np.asarray(Image.open(folder / "samples" / "step_000004.png")) for folder in (out, single)]
    assert grids[0].shape == grids[1].shape and np.array_equal(grids[0], grids[1])


def test_inductor_end_to_end_matches_eager(tmp_path):
    """The real backend, on the training UNet and on the sampling copy of the final grid: no break, no
    graph after warm-up, and the losses of the same run in eager mode (same recipe and seed).
    Steps 1 and 2 see the same weights (warmup: step 1 has lr 0), so the fused kernels must give the
    same loss up to float rounding. Step 3 may drift by ~1%: Adam divides by sqrt(v), which turns
    rounding-level differences in near-zero gradients into lr-sized updates.
    The suite's costliest test on a fresh machine (CI), whose cache is cold (figures at ONE_LEVEL)."""
    counts = counted_run(tmp_path, "--torch_compile", "--max_train_steps", 3, model=ONE_LEVEL, **FINAL_GRID)
    assert_stays_compiled(counts, warm=1)
    counted_run(tmp_path, "--max_train_steps", 3, output_dir=tmp_path / "eager", model=ONE_LEVEL, **FINAL_GRID)
    compiled = [h["loss"] for h in read_history(tmp_path / "run")]
    reference = [h["loss"] for h in read_history(tmp_path / "eager")]
    assert len(compiled) == len(reference) == 3
    assert compiled[:2] == pytest.approx(reference[:2], rel=1e-4)
    assert compiled[2] == pytest.approx(reference[2], rel=0.05)
    # checkpoint keys stay those of the plain UNet: a compiled run resumes into an uncompiled one
    from safetensors.torch import load_file
    assert not [k for k in load_file(tmp_path / "run" / "unet" / "diffusion_pytorch_model.safetensors")
                if "_orig_mod" in k]


def test_a_compile_mode_needs_inductor():
    from diffusion_extras.training.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match="--torch_compile_mode max-autotune is an inductor mode"):
        parse_config(["--torch_compile_mode", "max-autotune", "--torch_compile_backend", "eager"])


def test_the_sampling_copy_compiles_once_and_follows_the_weights():
    """The fp32 copy that grids and FID sample with is compiled once (no-grad graphs) and reused:
    later evaluations, with other weights (raw, EMA, trained further), capture no graph; each
    evaluation's images are those of a fresh eager copy of the same weights. 3 images in batches of
    2 (a ragged last batch) at each evaluation."""
    from diffusers import DDIMScheduler
    from helpers import tiny_unet

    from diffusion_extras.core.ema import ExponentialMovingAverage
    from diffusion_extras.evaluation import sampling
    from diffusion_extras.training.sampling_copy import SamplingCopy, sampling_unet
    unet = tiny_unet()
    ema = ExponentialMovingAverage(unet.parameters())
    scheduler = DDIMScheduler(num_train_timesteps=100)
    fresh_state()
    held, counts = SamplingCopy({"backend": "eager", "mode": None}), []
    for evaluation in range(3):
        with torch.no_grad():  # training moves the weights between evaluations
            for parameter in unet.parameters():
                parameter.add_(0.01 * (evaluation + 1))
        weights_ema = ema if evaluation == 1 else None
        with held(unet, weights_ema) as copy:
            images = sampling.generate(copy, scheduler, 3, 2, seed=evaluation, batch_size=2)
        counts.append(dynamo_counts())
        with sampling_unet(unet, weights_ema) as eager:
            np.testing.assert_array_equal(images, sampling.generate(eager, scheduler, 3, 2, seed=evaluation,
                                                                    batch_size=2))
    fresh_state()
    assert counts[0]["graphs"] >= 1 and counts[0]["breaks"] == 0
    assert counts[1] == counts[2] == counts[0], counts
