"""What the tests share: a tiny UNet recipe and model, the runners of the commands in this process,
files made for a test (images, tar shards, a VAE, a pipeline), comparisons of two runs, and the
recorder of host syncs. Processes of their own: tests/processes.py; faults and probes given to the
trainer: tests/faults.py; the Hub stand-in: tests/hub_server.py."""
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import traceback
import warnings

import numpy as np
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the tiny recipe
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


# A DiT small enough for a CPU step in milliseconds: 2 blocks of width 32 at 8 px, patch 2 (4x4 tokens).
TINY_DIT = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, patch_size=2)


def save_tiny_dit_config(folder) -> str:
    """A DiTTransformer2DModel config.json of TINY_DIT in `folder`, as --model_config_name_or_path
    takes it (the trainer sets its channels, size and classes from the data)."""
    from diffusers import DiTTransformer2DModel
    DiTTransformer2DModel(in_channels=1, sample_size=8, num_embeds_ada_norm=1, **TINY_DIT).save_config(folder)
    return str(folder)


def tiny_dit_recipe(folder) -> dict:
    """Recipe overrides that make the tiny recipe a tiny DiT's (no UNet mapping; write_tiny_recipe,
    tiny_run and the tiny_recipe fixture leave out a key overridden with None)."""
    return {"model": None, "model_type": "dit", "model_config_name_or_path": save_tiny_dit_config(folder / "tiny_dit")}


def write_tiny_recipe(folder, **overrides) -> str:
    """TINY_RECIPE with `overrides` as a YAML file in `folder` (named by its content); returns its
    path. An override None leaves the key out."""
    values = {key: value for key, value in {**TINY_RECIPE, **overrides}.items() if value is not None}
    path = os.path.join(folder, f"tiny-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh)
    return path



def tiny_run(tmp_path, *flags, hooks=None, output_dir=None, **recipe):
    """An in-process run set up (training.build.setup) from TINY_RECIPE with `recipe` overrides and
    `flags`, in `output_dir` (default tmp_path/run), with `hooks` (training.hooks.Hooks); use with
    the fresh_accelerate fixture. An override None leaves the key out (tiny_dit_recipe)."""
    from diffusion_extras.training import build
    from diffusion_extras.training.config import parse_config
    path = tmp_path / "recipe.yaml"
    values = {key: value for key, value in {**TINY_RECIPE, **recipe}.items() if value is not None}
    path.write_text(yaml.safe_dump(values))
    return build.setup(parse_config(["--config", str(path), "--output_dir", str(output_dir or tmp_path / "run"),
                                     *map(str, flags)]), hooks)


def first_step_inputs(tmp_path, *flags, **recipe):
    """One optimizer step of an in-process tiny run (tiny_run with `flags` and `recipe`): (the clean
    inputs of its micro-batches, the UNet's inputs [B, C + condition, H, W] of its calls), as the
    step made them. Use with the fresh_accelerate fixture."""
    from diffusion_extras.training import loop, step
    from diffusion_extras.training.hooks import Hooks

    cleans, inputs = [], []
    hooks = Hooks(model_input=lambda run, clean, micro_step: cleans.append(clean.clone()) or clean)
    run = tiny_run(tmp_path, *flags, hooks=hooks, **recipe)
    run.learner.unet.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    try:
        step.optimizer_step(run, loop.make_batches(run))
    finally:
        run.accelerator.end_training()
    return cleans, inputs


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


# 3 -> 2 channels, two blocks: factor 2 (8 px images -> 4x4 latents); ~15k parameters
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=2, block_out_channels=[8, 8], layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                norm_num_groups=4, sample_size=8)
LATENT_MODEL = {**TINY_RECIPE["model"], "in_channels": 2, "out_channels": 2}  # the tiny UNet on TINY_VAE's latents


def save_tiny_vae(path, seed: int = 0, **overrides) -> str:
    """A tiny AutoencoderKL saved with save_pretrained (TINY_VAE with `overrides`); returns the folder."""
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    AutoencoderKL(**{**TINY_VAE, **overrides}).save_pretrained(path)
    return str(path)



# ----------------------------------------------------------------------------- what users bring
HUB_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hub_configs")  # see its README.md
TINY_WIDTH = 8  # channels of every block of a model built from a corpus config (GroupNorm groups of 4)


def hub_config(path: str) -> dict:
    """A config of the corpus, tests/hub_configs/<path>, as its repository stores it."""
    with open(os.path.join(HUB_CONFIGS, path)) as fh:
        return json.load(fh)


def tiny_hub_config(path: str) -> dict:
    """The corpus config at `path` with its widths reduced for a CPU: TINY_WIDTH channels per block,
    one layer per block, GroupNorm groups of 4. Every other field as stored, absent ones absent."""
    values = hub_config(path)
    return {**values, "block_out_channels": [TINY_WIDTH] * len(values["block_out_channels"]),
            "layers_per_block": 1, "norm_num_groups": 4}


def save_from_hub_config(folder, path: str, seed: int = 0) -> str:
    """Weights built (from torch.manual_seed(seed)) from tiny_hub_config(path), saved with
    save_pretrained into `folder`, whose config.json then holds that config in the corpus file's
    form (its fields, in its order): what a user's download of that repo holds, narrower."""
    import diffusers
    values = tiny_hub_config(path)
    torch.manual_seed(seed)
    getattr(diffusers, values["_class_name"]).from_config(values).save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        fh.write(json.dumps(values, indent=2) + "\n")
    return str(folder)


def save_google_ddpm_form(folder, repo: str, seed: int = 0) -> str:
    """A pipeline folder laid out as google/ddpm-* repos store theirs: the UNet's config.json and
    weights at the root beside scheduler_config.json and model_index.json (no unet/, scheduler/;
    diffusers loads a missing subfolder from the root), from the corpus folder `repo`. Without a
    stored model_index.json in the corpus, none is written."""
    save_from_hub_config(folder, f"{repo}/config.json", seed)
    for name in ("scheduler_config.json", "model_index.json"):
        if os.path.isfile(os.path.join(HUB_CONFIGS, repo, name)):
            shutil.copyfile(os.path.join(HUB_CONFIGS, repo, name), os.path.join(folder, name))
    return str(folder)


DIT_XL_256 = "facebook--DiT-XL-2-256"
TINY_DIT_WIDTHS = dict(num_layers=2, num_attention_heads=2, attention_head_dim=8)  # a corpus DiT narrowed


def save_dit_pipeline_form(folder, seed: int = 0) -> str:
    """A pipeline folder as facebook/DiT-XL-2-256 stores it, narrower: its transformer/ (the corpus's
    older Transformer2DModel form, TINY_DIT_WIDTHS: 2 blocks of 2 heads of 8; its 32x32x4 latents, 1000
    classes and learned sigma as stored), scheduler/ (its DDIMScheduler config), and vae/ (the
    corpus's sd-vae-ft-mse form narrowed: factor 8, 4 latent channels), the model_index.json today's
    diffusers writes for a DiTPipeline. The weights are drawn from torch.manual_seed(seed)."""
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, Transformer2DModel
    stored = hub_config(f"{DIT_XL_256}/transformer/config.json")
    values = {**stored, **TINY_DIT_WIDTHS}
    torch.manual_seed(seed)
    transformer = Transformer2DModel.from_config(values)  # diffusers builds the older form as a DiT
    vae = AutoencoderKL.from_config(tiny_hub_config("stabilityai--sd-vae-ft-mse/config.json"))
    scheduler = DDIMScheduler.from_config(hub_config(f"{DIT_XL_256}/scheduler/scheduler_config.json"))
    DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler).save_pretrained(folder)
    for path, text in (("transformer/config.json", json.dumps(values, indent=2, sort_keys=True) + "\n"),
                       ("vae/config.json", json.dumps(tiny_hub_config("stabilityai--sd-vae-ft-mse/config.json"),
                                                      indent=2) + "\n")):
        with open(os.path.join(folder, path), "w") as fh:
            fh.write(text)
    shutil.copyfile(os.path.join(HUB_CONFIGS, DIT_XL_256, "scheduler", "scheduler_config.json"),
                    os.path.join(folder, "scheduler", "scheduler_config.json"))
    return str(folder)


# ----------------------------------------------------------------------------- files a test brings
def save_random_images(folder, count: int, height: int, width: int, seed: int = 0) -> str:
    """`count` random RGB PNGs 0.png, 1.png, ... in `folder` (created); returns the folder."""
    os.makedirs(folder, exist_ok=True)
    for index, image in enumerate(np.random.default_rng(seed).integers(0, 256, (count, height, width, 3),
                                                                        dtype=np.uint8)):
        Image.fromarray(image).save(os.path.join(folder, f"{index}.png"))
    return str(folder)


def write_tar_shards(folder, shards=3, per_shard=4, size=(10, 12), extension="jpg", grey_step=10, pixels=None,
                     entries=lambda i: {"cls": str(i)}):
    """Image i (grey value grey_step*i, or pixels[i]: uint8 HxW or HxWx3) in shard i // per_shard as JPEG
    (or PNG), with entries(i) beside it ({extension: text}; default a .cls label i), webdataset style
    (one key, several extensions; every key has the same ones)."""
    os.makedirs(folder, exist_ok=True)
    for shard in range(shards):
        with tarfile.open(os.path.join(folder, f"train-{shard:03d}.tar"), "w") as tar:
            for i in range(shard * per_shard, (shard + 1) * per_shard):
                encoded = io.BytesIO()
                image = Image.fromarray(np.full((*size, 3), grey_step * i % 256, np.uint8) if pixels is None
                                        else pixels[i])
                image.save(encoded, format={"jpg": "JPEG", "png": "PNG"}[extension])
                for name, payload in ((f"{i:05d}.{extension}", encoded.getvalue()),
                                      *((f"{i:05d}.{kind}", text.encode()) for kind, text in entries(i).items())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return str(folder)


def paired_images(count: int, height: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(`count` random grey uint8 images [N, H, W], their pairs): each image's mask, white where the
    image is brighter than mid-grey, so the pair of any crop or flip of an image is the same crop
    or flip of its mask (a condition the tests can recompute from the image alone)."""
    images = np.random.default_rng(seed).integers(0, 256, (count, height, width), dtype=np.uint8)
    return images, np.where(images > 127, 255, 0).astype(np.uint8)


def write_paired_parquet(path, images: np.ndarray, pairs: np.ndarray, column: str) -> str:
    """Grey uint8 images [N, H, W] and their pairs as one parquet file of two image columns, `image`
    and `column`; returns its path."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), column: datasets.Image()})
    datasets.Dataset.from_dict({"image": [Image.fromarray(image) for image in images],
                                column: [Image.fromarray(pair) for pair in pairs]}, features=features) \
        .to_parquet(str(path))
    return str(path)


def write_paired_folders(folder, images: np.ndarray, pairs: np.ndarray, pair_extension: str = ".bmp") -> tuple:
    """The images as PNGs under folder/images/<i % 2>/<i>.png and each pair at the same relative path
    under folder/pairs/ (as `pair_extension` files); returns (the images' folder, the pairs' folder)."""
    for index, (image, pair) in enumerate(zip(images, pairs)):
        for part, array, extension in (("images", image, ".png"), ("pairs", pair, pair_extension)):
            os.makedirs(os.path.join(folder, part, str(index % 2)), exist_ok=True)
            Image.fromarray(array).save(os.path.join(folder, part, str(index % 2), f"{index}{extension}"))
    return os.path.join(folder, "images"), os.path.join(folder, "pairs")


# ----------------------------------------------------------------------------- commands in this process
# Each runner returns a subprocess.CompletedProcess and, unless check=False (a test of a refusal, which
# then asserts the exit code itself), fails the test when the command exits non-zero. In processes of
# their own: processes.run_command and processes.launch_training, the same way.
def run_main(main, argv, *extra, env=None, merge_stderr=False, check=True):
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
    result = subprocess.CompletedProcess(argv, code or 0, out.getvalue(), "" if merge_stderr else err.getvalue())
    return checked(result, f"{main.__module__}.main {' '.join(argv)}", check)


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


COMMANDS = {"train_ddpm.py": "diffusion_extras.training.main",  # the main() of each command line
            "diffusion_extras.sample": "diffusion_extras.cli.sample",
            "diffusion_extras.evaluate": "diffusion_extras.cli.evaluate",
            "diffusion_extras.posthoc_ema": "diffusion_extras.cli.posthoc_ema",
            "diffusion_extras.report": "diffusion_extras.report.health"}


def run_cli(args, env=None, check=True, merge_stderr=False):
    """`python ARGS` (train_ddpm.py, or -m one of the package's commands) through that command's
    main() in this process (run_main)."""
    import importlib
    args = [str(arg) for arg in args]
    name, argv = (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
    return run_main(importlib.import_module(COMMANDS[name]).main, argv, env=env, merge_stderr=merge_stderr,
                    check=check)


def run_training(recipe, output_dir, *flags, hooks=None, env=None, check=True):
    """`train_ddpm.py --config RECIPE --output_dir OUTPUT_DIR FLAGS` in this process (run_main), with
    `hooks` (tests/faults.py makes them)."""
    from diffusion_extras.training.main import main
    return run_main(main, ["--config", recipe, "--output_dir", output_dir, *flags], hooks, env=env, check=check)


def checked(result, what: str, check: bool = True):
    """`result`; with `check`, a non-zero exit fails the test, naming `what`, the exit code and the end
    of what the command printed on stderr (or, merged, on stdout)."""
    if check and result.returncode != 0:
        raise AssertionError(f"{what} failed ({result.returncode}):\n{(result.stderr or result.stdout)[-4000:]}")
    return result


# ----------------------------------------------------------------------------- what a run wrote
def read_history(output_dir) -> list:
    with open(os.path.join(output_dir, "logs", "history.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_unet_weights(folder):
    """The exported model's weights: its unet/, or a DiT's transformer/."""
    part = "unet" if os.path.isdir(os.path.join(folder, "unet")) else "transformer"
    return load_file(os.path.join(folder, part, "diffusion_pytorch_model.safetensors"))


def optimizer_state(checkpoint):
    return torch.load(os.path.join(checkpoint, "optimizer.bin"), weights_only=False)


def cosine_lr(peak, step, warmup, total):
    """diffusers' cosine-with-warmup at `step` (the lr of history step step+1)."""
    if step < warmup:
        return peak * step / max(1, warmup)
    return peak * max(0.0, 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A floating tensor's bit patterns (as integers of its width), anything else as it is: equal bits
    are bitwise equality, under which a NaN equals the same NaN (a diagnostics bin never visited) and
    0.0 differs from -0.0, where torch.equal says the opposite of both."""
    if not tensor.is_floating_point():
        return tensor
    return tensor.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[tensor.element_size()])


def assert_same_tree(x, y, where: str) -> None:
    """x and y equal all the way down (dicts: same keys; lists: same length; tensors: bitwise)."""
    assert type(x) is type(y), f"{where}: {type(x).__name__} vs {type(y).__name__}"
    if isinstance(x, dict):
        assert x.keys() == y.keys(), f"{where}: keys {sorted(map(str, x))} vs {sorted(map(str, y))}"
        for key in x:
            assert_same_tree(x[key], y[key], f"{where}[{key!r}]")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), f"{where}: {len(x)} vs {len(y)} items"
        for index, (item_x, item_y) in enumerate(zip(x, y)):
            assert_same_tree(item_x, item_y, f"{where}[{index}]")
    elif isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y)), f"{where}: tensors differ"
    else:
        assert x == y or (x != x and y != y), f"{where}: {x!r} vs {y!r}"  # (nan == nan here)


def assert_same_state(a, b, step):
    """Same losses at every step, same exported (EMA) weights, and checkpoint-`step` the same in its
    training weights, optimizer state and every custom state (LR schedule, EMA, diagnostics, ...)."""
    la, lb = ([h for h in read_history(folder) if "loss" in h] for folder in (a, b))  # not FID, held-out, ...
    assert [h["step"] for h in la] == [h["step"] for h in lb] == list(range(1, step + 1))
    assert [h["loss"] for h in la] == [h["loss"] for h in lb]
    assert_same_tree(load_unet_weights(a), load_unet_weights(b), "exported weights")
    ca, cb = os.path.join(a, f"checkpoint-{step}"), os.path.join(b, f"checkpoint-{step}")
    states = sorted(name for name in os.listdir(ca) if name == "optimizer.bin" or name.startswith("custom_checkpoint_"))
    assert "optimizer.bin" in states and states == sorted(
        name for name in os.listdir(cb) if name == "optimizer.bin" or name.startswith("custom_checkpoint_"))
    assert_same_tree(load_file(os.path.join(ca, "model.safetensors")), load_file(os.path.join(cb, "model.safetensors")),
                     "training weights")
    for name in states:
        assert_same_tree(torch.load(os.path.join(ca, name), weights_only=True),
                         torch.load(os.path.join(cb, name), weights_only=True), f"checkpoint-{step}/{name}")


# ----------------------------------------------------------------------------- host syncs
# aten ops that read a device value on the host: scalar reads (.item(), bool(), float(), .tolist()),
# comparisons answered on the host, and ops whose output shape depends on the data.
SYNCING_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select",
               "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}
PROJECT = (os.path.join(ROOT, "train_ddpm.py"), os.path.join(ROOT, "diffusion_extras"))


def where(stack) -> str:
    """'function:line' of the innermost frame in the project's own code."""
    for frame in reversed(stack):
        if frame.filename.startswith(PROJECT):
            return f"{frame.name}:{frame.lineno}"
    return "outside the project"


class SyncRecorder(TorchDispatchMode):
    """Records host syncs with the phase of the loop they happen in (set by `phase`)."""

    def __init__(self):
        super().__init__()
        self.events = []          # (phase, op, where)
        self.phases = ["loop"]

    def record(self, op: str) -> None:
        self.events.append((self.phases[-1], op, where(traceback.extract_stack()[:-2])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS or (name == "index" and any(  # boolean-mask indexing runs nonzero
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)):
            self.record(name)
        return func(*args, **(kwargs or {}))

    def phase(self, name, function):
        def wrapped(*args, **kwargs):
            self.phases.append(name)
            try:
                return function(*args, **kwargs)
            finally:
                self.phases.pop()
        return wrapped

    def in_phase(self, name) -> list:
        return [(op, at) for phase, op, at in self.events if phase == name]


# Every extra of the optimizer step, for the tests that watch a step for host syncs (on CPU here, on
# a GPU in test_cuda).
ALL_EXTRAS = ("--use_ema", "--snr_gamma", 5, "--timestep_sampling", "loss_aware", "--posthoc_ema",
              "--gradient_accumulation_steps", 2, "--max_grad_norm", 1.0, "--variance_type", "learned_range",
              "--offset_noise", 0.1, "--class_conditional")  # labels, their dropout and the loss per class as well


# ----------------------------------------------------------------------------- the bound by hand
VLB_T = 10
VLB_BETAS = [0.0001 + (0.2 - 0.0001) * i / (VLB_T - 1) for i in range(VLB_T)]  # a short linear schedule


def normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def vlb_term_by_hand(x0, xt, eps_hat, v, t, variance_type):
    """L_{t-1} of the variational bound in bits for one element under VLB_BETAS, in Python floats
    (float64), written out from the formulas (Ho et al. 2020 Eq. 5-7 and 13; Nichol & Dhariwal 2021 Eq. 15)."""
    abar = [math.prod(1 - b for b in VLB_BETAS[:i + 1]) for i in range(VLB_T)]
    prev = 1.0 if t == 0 else abar[t - 1]
    post_var = [VLB_BETAS[i] * (1 - (1.0 if i == 0 else abar[i - 1])) / (1 - abar[i]) for i in range(VLB_T)]
    log_post_clipped = math.log(post_var[1] if t == 0 else post_var[t])
    x0_hat = (xt - math.sqrt(1 - abar[t]) * eps_hat) / math.sqrt(abar[t])

    def mean(x0_):
        return (VLB_BETAS[t] * math.sqrt(prev) / (1 - abar[t]) * x0_
                + (1 - prev) * math.sqrt(1 - VLB_BETAS[t]) / (1 - abar[t]) * xt)

    if variance_type == "learned_range":
        frac = (v + 1) / 2
        log_var = frac * math.log(VLB_BETAS[t]) + (1 - frac) * log_post_clipped
    else:
        log_var = log_post_clipped
    if t == 0:  # discretized decoder: the mass of x0's bin
        sd = math.exp(0.5 * log_var)
        upper = 1.0 if x0 > 0.999 else normal_cdf((x0 + 1 / 255 - mean(x0_hat)) / sd)
        lower = 0.0 if x0 < -0.999 else normal_cdf((x0 - 1 / 255 - mean(x0_hat)) / sd)
        return -math.log(upper - lower) / math.log(2)
    kl = 0.5 * (-1 + log_var - log_post_clipped + math.exp(log_post_clipped - log_var)
                + (mean(x0) - mean(x0_hat)) ** 2 * math.exp(-log_var))
    return kl / math.log(2)


# ----------------------------------------------------------------------------- bench/
def load_bench_module(name: str):
    """bench/<name>.py as a module (bench/ holds scripts, not a package), loaded once."""
    import importlib.util
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
