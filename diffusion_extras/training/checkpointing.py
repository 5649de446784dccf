"""Resumable checkpoints on top of `accelerator.save_state`: atomic, verified, pruned, checked.

Layout: OUTPUT_DIR/checkpoint-<step>/ holds what accelerate writes (model.safetensors,
optimizer.bin, scaler.pt, random_states_<rank>.pkl, custom_checkpoint_<i>.pkl for the LR
schedule, EMA and diagnostics) plus train_state.json (position, world size, the config that
shapes the state) and, written last, checkpoint_complete.json listing every file with its size
and checksum (xxh3-64 when xxhash is installed, as `datasets` brings it; else zlib's crc32).

Atomicity: every rank writes into `.checkpoint-<step>.tmp`; once all are done, the main process
fsyncs, writes the marker and renames the folder. A kill at any moment leaves either the
previous checkpoints untouched plus a tmp folder that nothing picks, or a complete checkpoint.
Multi-node runs need output_dir on a filesystem all nodes share (as accelerate assumes).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
import zlib
from dataclasses import fields

from diffusion_extras.training.config import APPLY, REFUSE, ConfigError, TrainConfig
from diffusion_extras.training.validation import checkpoint_folder

PREFIX = "checkpoint-"
MARKER = "checkpoint_complete.json"
TRAIN_STATE = "train_state.json"
SCALER_FILE = "scaler.pt"  # accelerate's SCALER_NAME
ABANDONED = "abandoned-"
# A checkpoint records keys that are not TrainConfig fields: the resolved UNet config (whose shape
# the weights have), the world size (every rank's RNG file and stream position), fine-tuning, the
# pretrained pipeline's configs as they were read (a resume reads them here, not from the Hub), and,
# for a latent run, its VAE (the fingerprint of its weights and the latents' normalisation: the
# space the UNet learned in, which a VAE changed under the same path would silently replace).
# Settings added since some checkpoints were written, with the value those checkpoints trained with:
# a resume that changes them is refused like any other (an older checkpoint trained DDPM).
RECORDED_BEFORE_ADDED = {"objective": "ddpm"}
RECORDED_KEY_POLICIES = {"unet": REFUSE, "num_processes": REFUSE, "pretrained": REFUSE, "vae": REFUSE}


def resume_policies() -> dict[str, str]:
    """refuse | apply | free for every key a checkpoint's recorded config holds, read from the
    TrainConfig fields' metadata (config._f) so the rules cannot drift from the fields."""
    return {f.name: f.metadata["resume"] for f in fields(TrainConfig)} | RECORDED_KEY_POLICIES


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


def refuse_fresh_run_over_checkpoints(output_dir: str, resume_from_checkpoint: str | None) -> None:
    """A run without --resume_from_checkpoint must not start over an output_dir with checkpoints:
    its first save would mix two runs' checkpoints (and the newest would no longer be this run's)."""
    checkpoints = list_checkpoints(output_dir)
    if checkpoints and resume_from_checkpoint is None:
        raise ConfigError(f"--output_dir {output_dir} already holds {os.path.basename(checkpoints[-1])}: "
                          "pass --resume_from_checkpoint latest to continue it, or choose a new --output_dir")


def verify_checkpoint(path: str) -> str | None:
    """None if the checkpoint is complete; else the reason it cannot be used. Reads every file
    once to check its checksum (cost: ~1 s per GB from page cache; markers written before
    checksums were recorded are checked by size only)."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return "it has no completion marker (the save was interrupted)"
    try:
        with open(marker) as fh:
            content = json.load(fh)
        sizes, checksums = content["files"], content.get("checksums", {})
    except (OSError, ValueError, KeyError) as error:
        return f"its completion marker is unreadable ({error})"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written (truncated or altered)"
        if name in checksums and file_checksum(file, checksums[name].split(":")[0]) != checksums[name]:
            return f"{name} does not match the checksum recorded when it was written (torn or altered)"
    return None


def _checksum_algorithm() -> str:
    try:
        import xxhash  # noqa: F401  (datasets depends on it)
        return "xxh3_64"
    except ImportError:
        return "crc32"


def file_checksum(path: str, algorithm: str | None = None, chunk_bytes: int = 1 << 22) -> str:
    """'<algorithm>:<hex>' of a file, read in 4 MiB chunks (a checkpoint may not fit in memory
    twice). xxh3-64 runs at memory speed; zlib's crc32 is the stdlib fallback (~1 GB/s)."""
    algorithm = algorithm or _checksum_algorithm()
    if algorithm == "xxh3_64":
        import xxhash
        digest = xxhash.xxh3_64()
        update, value = digest.update, lambda: digest.intdigest()
    elif algorithm == "crc32":
        crc = [0]
        update, value = (lambda chunk: crc.__setitem__(0, zlib.crc32(chunk, crc[0]))), (lambda: crc[0])
    else:
        return f"{algorithm}:unknown algorithm"  # never matches: the file is treated as unverifiable
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            update(chunk)
    return f"{algorithm}:{value():016x}"


def resume_candidates(output_dir: str, resume_from: str) -> list[str]:
    """Checkpoints to try, best first. 'latest': complete ones, newest first, warning about each
    newer one that is incomplete; a name in output_dir or a path (validation.checkpoint_folder): that
    one only, and it must be complete."""
    if resume_from != "latest":
        path = checkpoint_folder(resume_from, output_dir)
        if not os.path.isdir(path):
            raise CheckpointError(f"--resume_from_checkpoint {resume_from}: no such folder {path}")
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(f"--resume_from_checkpoint {resume_from} cannot be used: {problem}; "
                                  "give an earlier checkpoint or 'latest'")
        return [path]
    candidates = []
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify_checkpoint(path)
        if problem:
            warnings.warn(f"skipping {path}: {problem}; falling back to the previous checkpoint", stacklevel=2)
        else:
            candidates.append(path)
    return candidates


def recorded_config(output_dir: str, resume_from: str | None) -> dict | None:
    """The config recorded by the checkpoint a resume would start from (its train_state.json), or
    None when none would (no --resume_from_checkpoint, or 'latest' and no checkpoint yet). Quiet:
    resume() names the incomplete checkpoints it passes over."""
    if not resume_from:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidates = resume_candidates(output_dir, resume_from)
    return read_train_state(candidates[0])["config"] if candidates else None


def _fsync_tree(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            file = os.path.join(root, name)
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
            sizes[os.path.relpath(file, directory)] = os.path.getsize(file)
    return sizes


def completion_marker(directory: str, step: int, checksums: bool = True) -> dict:
    """What checkpoint_complete.json records: every file's size and (unless turned off, for the
    benchmark's comparison) checksum, read back after the fsync."""
    sizes = _fsync_tree(directory)
    marker = {"step": step, "files": sizes}
    if checksums:
        marker["checksums"] = {name: file_checksum(os.path.join(directory, name)) for name in sizes}
    return marker


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def rank_state_file(process_index: int) -> str:
    return f"rank_state_{process_index}.json"


def read_rank_state(checkpoint: str, process_index: int):
    """This rank's saved data-source state in a checkpoint folder, or None when none was saved."""
    path = os.path.join(checkpoint, rank_state_file(process_index))
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def temporary_folder(output_dir: str, step: int) -> str:
    """Where checkpoint-<step> is written until it is complete."""
    return os.path.join(output_dir, f".{PREFIX}{step}.tmp")


def save_checkpoint(accelerator, output_dir: str, step: int, train_state: dict,
                    total_limit: int | None = None, rank_state: dict | None = None, checksums: bool = True,
                    before_marker=None) -> str:
    """Save on every rank (accelerate requires it: each rank writes its RNG state, and DeepSpeed or
    FSDP shard weights), then complete and publish the folder on the main process. `rank_state`
    (e.g. a stream position) differs per rank, so each rank writes its own file. `before_marker(tmp)`
    runs on the main process when every file is written and none is marked complete yet."""
    final, tmp = os.path.join(output_dir, f"{PREFIX}{step}"), temporary_folder(output_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this very step
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    with _scaler_saved_by_main_process_only(accelerator):
        accelerator.save_state(tmp)
    if rank_state is not None:
        _write_json(os.path.join(tmp, rank_state_file(accelerator.process_index)), rank_state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json(os.path.join(tmp, TRAIN_STATE), train_state)
        if before_marker is not None:
            before_marker(tmp)
        _write_json(os.path.join(tmp, MARKER), completion_marker(tmp, step, checksums))
        if os.path.exists(final):  # same step saved before (e.g. an explicit re-save): replace it last
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(output_dir)
        if total_limit:
            prune_checkpoints(output_dir, total_limit)
    accelerator.wait_for_everyone()
    return final


@contextlib.contextmanager
def _scaler_saved_by_main_process_only(accelerator):
    """accelerate 1.15's save_accelerator_state writes scaler.pt with a bare torch.save on every
    rank, to the one shared path (the model and optimizer go through its main-process-only
    `save`): concurrent writers can tear it. The GradScaler's state is identical on every rank (it
    sees the all-reduced gradients), so the other ranks save without it."""
    scaler = accelerator.scaler
    if not accelerator.is_main_process:
        accelerator.scaler = None
    try:
        yield
    finally:
        accelerator.scaler = scaler


def load_state(accelerator, path: str) -> bool:
    """accelerator.load_state, also from a checkpoint saved without fp16 (no scaler.pt) into an fp16
    run: its GradScaler then starts fresh, as in a new fp16 run. True when that happened."""
    scaler = accelerator.scaler
    fresh_scaler = scaler is not None and not os.path.isfile(os.path.join(path, SCALER_FILE))
    if fresh_scaler:
        accelerator.scaler = None  # accelerate would try to read the missing scaler.pt
    try:
        accelerator.load_state(path)
    finally:
        accelerator.scaler = scaler
    return fresh_scaler


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


# The EMA's state in a checkpoint of a run with use_ema: accelerate numbers the registered objects in
# order, and build.register_checkpointed_state registers the LR schedule first, the EMA second.
EMA_STATE = "custom_checkpoint_1.pkl"


def checkpoint_model(path: str, ema: bool = True):
    """(model, "EMA" | "raw") of a training checkpoint: the model config it records (a UNet2DModel's,
    or a DiTTransformer2DModel's for a --model_type dit run), with the run's EMA weights where it
    kept an EMA and `ema` asks for them (what the exported pipeline holds, and what Karras et al.
    guide with), else the raw weights of that step (accelerate's model.safetensors)."""
    import torch
    from safetensors.torch import load_file

    from diffusion_extras.evaluation.pipeline_backbone import backbone_named

    config = read_train_state(path)["config"]
    # (checkpoints from before --model_type record none: a UNet)
    unet = backbone_named(config.get("model_type")).model_class.from_config(config["unet"])
    if ema and config.get("use_ema"):
        shadow = torch.load(os.path.join(path, EMA_STATE), weights_only=True)["shadow_params"]
        with torch.no_grad():
            for parameter, value in zip(unet.parameters(), shadow, strict=True):
                parameter.copy_(value)
        return unet, "EMA"
    unet.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    return unet, "raw"


def compare_configs(saved: dict, current: dict) -> dict[str, dict[str, tuple]]:
    """{policy: {key: (saved, current)}} for every recorded key whose value changed. Keys the
    checkpoint does not record (settings added since it was written) are not compared."""
    policies, changes = resume_policies(), {}
    saved = {**RECORDED_BEFORE_ADDED, **saved}
    for key in saved.keys() & current.keys():
        if saved[key] != current[key] and key in policies:
            changes.setdefault(policies[key], {})[key] = (saved[key], current[key])
    return changes


def describe_change(key: str, old, new) -> str:
    """'key: old -> new'; for nested settings (the UNet config) only the differing entries."""
    if isinstance(old, dict) and isinstance(new, dict):
        inner = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        return ", ".join(f"{key}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in inner)
    return f"{key}: {old!r} -> {new!r}"


def _unflatten(value):
    """The recorded config stores non-scalars as JSON (tracking.hyperparameters): decode for display."""
    if isinstance(value, str) and (value[:1] in ("[", "{") or value == "null"):
        with contextlib.suppress(ValueError):
            return json.loads(value)
    return value


def check_resumable(path: str, current: dict, reconcile=None) -> tuple[dict, dict[str, tuple]]:
    """The checkpoint's train state and the changed settings a resume applies ({key: (saved,
    current)}, for the caller to announce), after refusing, with the full list, any change the
    saved state cannot serve. `reconcile(recorded config)` -> the recorded config as this release
    writes it (a record in an earlier release's form that is recognised as the current one), before
    the comparison."""
    state = read_train_state(path)
    if reconcile is not None:
        state = {**state, "config": reconcile(state["config"])}
    changes = compare_configs(state["config"], current)
    refused = changes.get(REFUSE, {})
    if refused:
        raise CheckpointError(
            f"cannot resume from {path}: the config differs in ways the saved state depends on: "
            + "; ".join(describe_change(k, *_decoded(refused[k])) for k in sorted(refused))
            + ". Resume with the original settings or start a new --output_dir")
    # no warning here: resume() prints one line per applied change (resume_policy.applied_change_lines)
    return state, {k: _decoded(v) for k, v in sorted(changes.get(APPLY, {}).items())}


def _decoded(pair: tuple) -> tuple:
    return tuple(_unflatten(v) for v in pair)


def abandon_newer(output_dir: str, step: int, also_copy: tuple = ()) -> str | None:
    """A rollback: move the checkpoints newer than `step` (the future being abandoned) into
    output_dir/abandoned-<step>-<time>/, with copies of `also_copy` (the log history that the
    resumed run truncates). Nothing is deleted; `latest` and retention list only top-level
    checkpoint-<step> folders, so they never see these again. Returns the folder, or None."""
    newer = [path for path in list_checkpoints(output_dir) if checkpoint_step(path) > step]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = os.path.join(output_dir, f"{ABANDONED}{step}-{stamp}")
    suffix = 1
    while os.path.exists(folder):  # a second rollback within the same second
        folder, suffix = os.path.join(output_dir, f"{ABANDONED}{step}-{stamp}-{suffix}"), suffix + 1
    os.makedirs(folder)
    for path in also_copy:
        if os.path.isfile(path):
            shutil.copy2(path, folder)
    for path in newer:
        os.rename(path, os.path.join(folder, os.path.basename(path)))
    _fsync_dir(output_dir)
    return folder
