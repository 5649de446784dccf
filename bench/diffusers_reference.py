"""Time diffusers' examples/unconditional_image_generation/train_unconditional.py, unmodified.

The script prints no timings, but it calls `loss.item()` every step (a host sync) and then
updates a tqdm bar on stderr. So the moment a bar update "n/total" reaches us, step n has
finished on the device: we stamp each update with our own clock as it arrives and take the
rate between the first update past warmup and the last one. The bar refreshes at most every
0.1 s, which bounds the timing error per end point. Once enough steps are seen the run is
stopped: at the end of epoch 0 the script would sample and save a pipeline, which is not a step.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

# tqdm's bar: "... 37/220 [00:01<00:05, 31.2it/s, ...]": the count sits before " [elapsed<".
PROGRESS = re.compile(rb"(\d+)/(\d+) \[(?:\d+:)?\d+:\d+<")


def reference_flags(config, unet_config_path: str, data_dir: str, output_dir: str, cache_dir: str) -> list[str]:
    """train_unconditional.py flags that reproduce our recipe (UNet, batch, optimiser, EMA, precision,
    noise schedule, data augmentation). It has no min-SNR, zero-SNR or v-prediction: callers skip those."""
    flags = ["--dataset_name", data_dir, "--cache_dir", cache_dir, "--output_dir", output_dir,
             "--model_config_name_or_path", unet_config_path, "--resolution", str(config.resolution),
             "--train_batch_size", str(config.train_batch_size),
             "--gradient_accumulation_steps", str(config.gradient_accumulation_steps),
             "--dataloader_num_workers", str(config.dataloader_num_workers),
             "--learning_rate", str(config.learning_rate), "--lr_scheduler", config.lr_scheduler,
             "--lr_warmup_steps", str(config.lr_warmup_steps), "--adam_beta1", str(config.adam_beta1),
             "--adam_beta2", str(config.adam_beta2), "--adam_weight_decay", str(config.adam_weight_decay),
             "--adam_epsilon", str(config.adam_epsilon), "--mixed_precision", config.mixed_precision,
             "--prediction_type", config.prediction_type, "--ddpm_num_steps", str(config.ddpm_num_steps),
             "--ddpm_beta_schedule", config.ddpm_beta_schedule, "--logger", "tensorboard",
             # One epoch, no checkpoint; the end-of-epoch sample and save come after we stop it.
             "--num_epochs", "1", "--checkpointing_steps", str(10 ** 9), "--save_images_epochs", str(10 ** 6),
             "--save_model_epochs", str(10 ** 6), "--eval_batch_size", "1", "--ddpm_num_inference_steps", "1"]
    if config.center_crop:
        flags.append("--center_crop")
    if config.random_flip:
        flags.append("--random_flip")
    if config.use_ema:
        flags += ["--use_ema", "--ema_max_decay", str(config.ema_max_decay),
                  "--ema_inv_gamma", str(config.ema_inv_gamma), "--ema_power", str(config.ema_power)]
    return flags


def unsupported(config) -> str | None:
    """Why the script cannot run this recipe, or None."""
    if config.prediction_type not in ("epsilon", "sample"):
        return f"train_unconditional.py has no --prediction_type {config.prediction_type}"
    if config.model.get("in_channels", 3) != 3 and not config.model_config_name_or_path:
        return "train_unconditional.py converts every image to RGB: it cannot train a grayscale UNet"
    return None


def launch_command(script: str, mixed_precision: str, flags: list[str]) -> list[str]:
    """`accelerate launch` on one process, every setting given so no accelerate config file is read."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", mixed_precision, "--dynamo_backend", "no", script, *flags]


def write_unet_config(values: dict, path: str) -> str:
    with open(path, "w") as fh:
        json.dump({"_class_name": "UNet2DModel", **values}, fh, indent=1)
    return path


def follow_progress(command: list[str], stop_at: int, timeout: float, env: dict | None = None,
                    log_path: str | None = None) -> tuple[list[tuple[int, float]], int | None, str]:
    """Run `command`, stamp every new tqdm count on stderr with perf_counter(); stop the process
    group once the count reaches `stop_at`. Returns (points, exit code or None if we stopped it,
    the output's tail)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)  # its own process group, to stop its children too
    points, tail, buffer = [], bytearray(), b""
    timer = threading.Timer(timeout, _stop, (process,))
    timer.start()
    log = open(log_path, "wb") if log_path else None
    try:
        while True:
            chunk = process.stdout.read1(65536)
            if not chunk:
                break
            now = time.perf_counter()
            if log:
                log.write(chunk)
            tail = (tail + chunk)[-4000:]
            buffer += chunk
            *pieces, buffer = re.split(rb"[\r\n]", buffer)
            for piece in pieces:
                match = PROGRESS.search(piece)
                if match and (not points or int(match.group(1)) > points[-1][0]):
                    points.append((int(match.group(1)), now))
            if points and points[-1][0] >= stop_at:
                _stop(process)
                break
    finally:
        timer.cancel()
        if log:
            log.close()
    stopped = points and points[-1][0] >= stop_at
    code = process.wait()
    return points, (None if stopped else code), tail.decode(errors="replace")


class GpuMemoryPeak:
    """Peak GPU memory (MiB, as nvidia-smi reports: allocator cache and CUDA context included) of
    every compute process but ours, sampled every 0.2 s while the reference runs. None if
    nvidia-smi cannot list processes (some virtual machines hide them)."""

    def __init__(self, exclude_pid: int):
        self.exclude_pid, self.peak, self._done = exclude_pid, None, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _poll(self):
        while not self._done.wait(0.2):
            used = [mib for pid, mib in compute_apps_memory_mib().items() if pid != self.exclude_pid]
            if used:
                self.peak = max(self.peak or 0, sum(used))


def compute_apps_memory_mib() -> dict[int, int]:
    """{pid: MiB} of the GPU's compute processes as nvidia-smi lists them; {} when it cannot."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = (line.split(",") for line in out.splitlines() if line.count(",") == 1)
    return {int(pid): int(mib) for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}


def _stop(process: subprocess.Popen) -> None:
    """Stop the launcher and the training process it started (its own session, so its own group)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def steps_per_second(points: list[tuple[int, float]], warmup: int) -> tuple[float, int, float] | None:
    """(steps/s, steps timed, seconds) between the first count >= warmup and the last count."""
    timed = [(n, t) for n, t in points if n >= warmup]
    if len(timed) < 2 or timed[-1][0] == timed[0][0]:
        return None
    steps, seconds = timed[-1][0] - timed[0][0], timed[-1][1] - timed[0][1]
    return steps / seconds, steps, seconds


def run_reference(args, config, workdir: str, data_dir: str, our_images_per_s: float) -> dict:
    """Run and time train_unconditional.py with our recipe's settings; a dict with `status`
    "ok", "skipped" (why in `note`) or "failed" (its output's tail in `note`)."""
    from diffusion_extras.training import models

    if not args.diffusers_script:
        return {"status": "skipped", "note": "no --diffusers_script given (see bench/README.md)"}
    import torch
    if not torch.cuda.is_available():
        return {"status": "skipped", "note": "no CUDA device: the comparison is a GPU measurement"}
    if unsupported(config):
        return {"status": "skipped", "note": unsupported(config)}
    unet_config = write_unet_config(models.unet_config(config), os.path.join(workdir, "unet_config.json"))
    flags = reference_flags(config, unet_config, data_dir, os.path.join(workdir, "diffusers_out"),
                            os.path.join(workdir, "diffusers_cache"))
    command = launch_command(args.diffusers_script, config.mixed_precision, flags)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONUNBUFFERED": "1"}
    stop_at = args.diffusers_warmup + args.diffusers_steps
    with GpuMemoryPeak(os.getpid()) as memory:
        points, code, tail = follow_progress(command, stop_at, args.diffusers_timeout, env,
                                             os.path.join(workdir, "diffusers.log"))
    rate = steps_per_second(points, args.diffusers_warmup)
    if rate is None:
        last = points[-1][0] if points else None
        return {"status": "failed", "command": command, "exit_code": code,
                "note": f"no step rate read (last count {last}); output tail: {tail[-1500:]}"}
    images_per_s = rate[0] * config.train_batch_size * config.gradient_accumulation_steps
    return {"status": "ok", "command": command, "images_per_s": images_per_s, "step_s": 1.0 / rate[0],
            "steps_timed": rate[1], "seconds_timed": rate[2], "peak_process_memory_mib_nvidia_smi": memory.peak,
            "ours_full_over_diffusers_images_per_s": our_images_per_s / images_per_s}
