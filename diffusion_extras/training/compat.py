"""diffusers' examples/unconditional_image_generation/train_unconditional.py command lines, taken
as they are: the flags that have no field of their own here are mapped to ours, with the mapping
stated in the log. (Flags of the same name and meaning are ordinary TrainConfig fields.)

    --save_images_epochs N / --save_model_epochs N   -> --save_images_steps / --save_model_steps
                                                        N x (optimizer steps per epoch)
    --overwrite_output_dir                           -> an earlier run in --output_dir is moved aside
                                                        (one rename, nothing deleted); a fresh start
    --enable_xformers_memory_efficient_attention     -> PyTorch SDPA, diffusers' default already
    --local_rank                                     -> accelerate sets the rank (diffusers too)
"""
from __future__ import annotations

import os
import time

from diffusion_extras.training.config import ConfigError, TrainConfig


def epoch_intervals(config: TrainConfig, steps_per_epoch: int | None) -> tuple[dict, list[str]]:
    """({"save_images_steps": ..., "save_model_steps": ...}, the lines saying how diffusers' epoch
    intervals became steps): N x steps_per_epoch optimizer steps, which periodic.interval_due counts
    from the end of the first epoch, as diffusers saves (`epoch % N == 0`, 0-based: the epochs 1,
    N + 1, 2N + 1, ...) and at the last step. The config is left as given."""
    intervals, lines = {}, []
    for unit in ("images", "model"):
        epochs = getattr(config, f"save_{unit}_epochs")
        intervals[f"save_{unit}_steps"] = getattr(config, f"save_{unit}_steps")
        if epochs is None:
            continue
        if steps_per_epoch is None:
            raise ConfigError(f"--save_{unit}_epochs: a streamed dataset has no known epoch length; "
                              f"give --save_{unit}_steps instead")
        intervals[f"save_{unit}_steps"] = epochs * steps_per_epoch
        lines.append(f"--save_{unit}_epochs {epochs} -> --save_{unit}_steps {epochs * steps_per_epoch} "
                     f"({steps_per_epoch} optimizer steps per epoch) from step {steps_per_epoch}, the end of "
                     "the first epoch, as diffusers")
    return intervals, lines


def move_aside_earlier_run(output_dir: str) -> str | None:
    """--overwrite_output_dir: start afresh without losing anything. diffusers parses this flag and
    ignores it; here a non-empty --output_dir (checkpoints, pipeline, logs) is renamed to
    <output_dir>.previous-<UTC time> in one step, so nothing written is deleted or mixed with the
    new run. Returns the new name of the earlier run, or None when there was nothing to move."""
    if not os.path.isdir(output_dir) or not os.listdir(output_dir):
        return None
    base = f"{os.path.normpath(output_dir)}.previous-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    target, suffix = base, 1
    while os.path.exists(target):
        target, suffix = f"{base}-{suffix}", suffix + 1
    os.rename(output_dir, target)
    return target


def notes(config: TrainConfig) -> list[str]:
    """Lines for flags that are accepted but need nothing done."""
    lines = []
    if config.enable_xformers_memory_efficient_attention:
        lines.append("--enable_xformers_memory_efficient_attention: attention already runs through PyTorch's "
                     "scaled_dot_product_attention (diffusers' default AttnProcessor2_0, with its memory-efficient "
                     "and flash kernels on GPU); xformers is not used")
    return lines
