"""Trackers through Accelerate (tensorboard, wandb), images to them, and the JSONL history that the
health report reads back."""
from __future__ import annotations

import json
import os

import numpy as np

from diffusion_extras.hub.secrets import redact_config
from diffusion_extras.training.config import ConfigError


def tracker_names(logger: str) -> list[str]:
    return {"none": [], "all": ["tensorboard", "wandb"]}.get(logger, [logger])


def check_tracker_available(logger: str) -> None:
    if "wandb" in tracker_names(logger):
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("--logger wandb needs the wandb package: pip install wandb "
                              "(set WANDB_MODE=offline to log without an account)") from None
        if not _wandb_can_log():
            raise ConfigError("--logger wandb: no wandb login found; run `wandb login` (or set WANDB_API_KEY), "
                              "or set WANDB_MODE=offline to log locally and `wandb sync` later")


def _wandb_can_log() -> bool:
    """Offline/disabled modes need no account; online needs a key (env or ~/.netrc)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))
    return os.path.isfile(netrc) and "api.wandb.ai" in open(netrc).read()


def hyperparameters(config: dict) -> dict:
    """Trackers take scalars: lists and dicts become strings; secrets are dropped."""
    flat = {}
    for key, value in redact_config(config).items():
        flat[key] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return flat


def log_image(accelerator, name: str, image: np.ndarray, step: int) -> None:
    """One uint8 HWC image to every active tracker (each wants its own layout)."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({name: image[None]}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({name: [image]}, step=step)


class History:
    """Append-only JSONL of logged values (main process), read by diffusion_extras.report.health."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, "logs", "history.jsonl")

    def append(self, values: dict) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        line = (json.dumps(values, sort_keys=True) + "\n").encode()
        with open(self.path, "ab", buffering=0) as fh:  # unbuffered: a failed write fails here
            size = fh.tell()
            try:
                while line:
                    line = line[fh.write(line):]
            except OSError:  # e.g. a full disk: leave no torn last line for a resume to choke on
                fh.truncate(size)
                raise

    def truncate_after(self, step: int) -> None:
        """On resume, drop entries logged after the checkpoint so the history has no duplicates."""
        if not os.path.isfile(self.path):
            return
        with open(self.path) as fh:
            kept = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.path, "w") as fh:
            fh.writelines(kept)

    def read(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as fh:
            return [json.loads(line) for line in fh if line.strip()]
