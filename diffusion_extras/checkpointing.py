"""Resumable checkpoints on top of `accelerator.save_state`: atomic, verified, pruned, checked.

Layout: OUTPUT_DIR/checkpoint-<step>/ holds what accelerate writes (model.safetensors,
optimizer.bin, scaler.pt, random_states_<rank>.pkl, custom_checkpoint_<i>.pkl for the LR
schedule, EMA and diagnostics) plus train_state.json (position, world size, the config that
shapes the state) and, written last, checkpoint_complete.json listing every file and its size.

Atomicity: every rank writes into `.checkpoint-<step>.tmp`; once all are done, the main process
fsyncs, writes the marker and renames the folder. A kill at any moment leaves either the
previous checkpoints untouched plus a tmp folder that nothing picks, or a complete checkpoint.
Multi-node runs need output_dir on a filesystem all nodes share (as accelerate assumes).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings

PREFIX = "checkpoint-"
MARKER = "checkpoint_complete.json"
TRAIN_STATE = "train_state.json"
# Settings that shape the saved state: resuming with another value would load wrong or mismatched state.
STATE_SHAPING_KEYS = ("unet", "streaming", "timestep_sampling", "posthoc_ema", "diagnostics_bins", "prediction_type", "ddpm_num_steps", "ddpm_beta_schedule", "resolution",
                      "train_batch_size", "gradient_accumulation_steps", "num_processes", "use_ema",
                      "mixed_precision")
# Settings that change what the resumed run does compared with an uninterrupted one, but load fine.
RUN_CHANGING_KEYS = ("seed", "learning_rate", "lr_scheduler", "lr_warmup_steps", "adam_beta1", "adam_beta2",
                     "adam_weight_decay", "max_grad_norm", "dataset_name", "train_data_dir", "max_train_samples",
                     "ema_max_decay", "ema_inv_gamma", "ema_power", "snr_gamma", "loss_type",
                     "max_train_steps")  # a new length rescales the LR decay from here on


class CheckpointError(ValueError):
    """A resume that cannot go ahead; the message says why and what to do."""


def checkpoint_step(path: str) -> int | None:
    match = re.fullmatch(PREFIX + r"(\d+)", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str) -> list[str]:
    """Finished checkpoint folders (by name), oldest first. Tmp folders are never listed."""
    if not os.path.isdir(output_dir):
        return []
    found = [(checkpoint_step(name), os.path.join(output_dir, name)) for name in os.listdir(output_dir)]
    return [path for step, path in sorted(f for f in found if f[0] is not None)
            if os.path.isdir(path)]


def verify_checkpoint(path: str) -> str | None:
    """None if the checkpoint is complete; else the reason it cannot be used."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return "it has no completion marker (the save was interrupted)"
    try:
        with open(marker) as fh:
            sizes = json.load(fh)["files"]
    except (OSError, ValueError, KeyError) as error:
        return f"its completion marker is unreadable ({error})"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written (truncated or altered)"
    return None


def resume_candidates(output_dir: str, resume_from: str) -> list[str]:
    """Checkpoints to try, best first. 'latest': complete ones, newest first, warning about each
    newer one that is incomplete; a path: that one only, and it must be complete."""
    if resume_from != "latest":
        path = os.path.abspath(os.path.expanduser(resume_from))
        if not os.path.isdir(path):
            raise CheckpointError(f"--resume_from_checkpoint {resume_from}: no such folder")
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(f"--resume_from_checkpoint {resume_from} cannot be used: {problem}; "
                                  "give an earlier checkpoint or 'latest'")
        return [path]
    candidates = []
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(path)
        if problem:
            warnings.warn(f"skipping {path}: {problem}; falling back to the previous checkpoint")
        else:
            candidates.append(path)
    return candidates


def _fsync_tree(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            file = os.path.join(root, name)
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
            sizes[os.path.relpath(file, directory)] = os.path.getsize(file)
    return sizes


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def rank_state_file(process_index: int) -> str:
    return f"rank_state_{process_index}.json"


def save_checkpoint(accelerator, output_dir: str, step: int, train_state: dict,
                    total_limit: int | None = None, rank_state: dict | None = None) -> str:
    """Save on every rank (accelerate requires it: each rank writes its RNG state, and DeepSpeed or
    FSDP shard weights), then complete and publish the folder on the main process. `rank_state`
    (e.g. a stream position) differs per rank, so each rank writes its own file."""
    final = os.path.join(output_dir, f"{PREFIX}{step}")
    tmp = os.path.join(output_dir, f".{PREFIX}{step}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this very step
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    if rank_state is not None:
        _write_json(os.path.join(tmp, rank_state_file(accelerator.process_index)), rank_state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json(os.path.join(tmp, TRAIN_STATE), train_state)
        _write_json(os.path.join(tmp, MARKER), {"step": step, "files": _fsync_tree(tmp)})
        if os.path.exists(final):  # same step saved before (e.g. an explicit re-save): replace it last
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(output_dir)
        if total_limit:
            prune_checkpoints(output_dir, total_limit)
    accelerator.wait_for_everyone()
    return final


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_checkpoints(output_dir: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoints (called only after a new one is complete)."""
    doomed = list_checkpoints(output_dir)[:-keep] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_train_state(path: str) -> dict:
    with open(os.path.join(path, TRAIN_STATE)) as fh:
        return json.load(fh)


def compare_configs(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(state-breaking differences, run-changing differences) as 'key: saved -> current' lines;
    for nested settings (the UNet config) only the differing entries are named."""
    def describe(key):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            inner = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            return ", ".join(f"{key}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in inner)
        return f"{key}: {old!r} -> {new!r}"

    def diffs(keys):
        return [describe(key) for key in keys if key in saved and saved.get(key) != current.get(key)]
    return diffs(STATE_SHAPING_KEYS), diffs(RUN_CHANGING_KEYS)


def check_resumable(path: str, current: dict) -> dict:
    """The checkpoint's train state, after refusing state-breaking config changes (listed)."""
    state = read_train_state(path)
    breaking, changing = compare_configs(state["config"], current)
    if breaking:
        raise CheckpointError(
            f"cannot resume from {path}: the config differs in ways the saved state depends on: "
            + "; ".join(breaking) + ". Resume with the original settings or start a new --output_dir")
    if changing:
        warnings.warn("resuming with changed settings; the run will differ from an uninterrupted one: "
                      + "; ".join(changing))
    return state
