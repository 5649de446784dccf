#!/usr/bin/env python
"""Class accuracy of guided sampling the way users reach it:

    python bench/guidance_check.py RUN_DIR [--guidance_scales 2,3,4] [--per_class 10]

1. the Hub-style load in a process where diffusion_extras cannot be imported:
   DiffusionPipeline.from_pretrained(RUN_DIR, trust_remote_code=True), with the pipeline's own
   scheduler and with DDIMScheduler.from_config(pipe.scheduler.config) swapped in;
2. the real command line, `python -m diffusion_extras.sample RUN_DIR --class_labels ... --scheduler ddim`.
The images are scored here by bench/quality.py's digit classifier (its training split; the run
must have been trained with bench/quality.py's --validation_split). 50 steps, seed 1.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from quality import DigitScorer  # noqa: E402

WITHOUT_PACKAGE = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "diffusion_extras" or name.startswith("diffusion_extras."):
            raise ImportError("blocked: the user does not have the training package")
sys.meta_path.insert(0, Block())
import numpy as np, torch
from diffusers import DDIMScheduler, DiffusionPipeline
folder, scheduler, scale, per_class, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
if scheduler == "ddim":
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
pipe.set_progress_bar_config(disable=True)
labels = [k for k in range(len(pipe.id2label)) for _ in range(per_class)]
images = pipe(class_labels=labels, guidance_scale=scale, num_inference_steps=50,
              generator=torch.Generator().manual_seed(1), output_type="np").images
np.savez(out, images=(np.asarray(images) * 255).round().astype(np.uint8), labels=np.asarray(labels))
"""


def hub_style(folder: str, scheduler: str, scale: float, per_class: int, work: str) -> tuple[np.ndarray, np.ndarray]:
    script, out = os.path.join(work, "load.py"), os.path.join(work, "hub.npz")
    with open(script, "w") as fh:
        fh.write(WITHOUT_PACKAGE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, script, folder, scheduler, str(scale), str(per_class), out], check=True,
                   cwd=work, env={**env, "HF_HUB_OFFLINE": "1"})
    data = np.load(out)
    return data["images"], data["labels"]


def command_line(folder: str, scale: float, per_class: int, work: str) -> tuple[np.ndarray, np.ndarray]:
    out = os.path.join(work, f"cli-{scale}")
    labels = [k for k in range(10) for _ in range(per_class)]
    subprocess.run([sys.executable, "-m", "diffusion_extras.sample", folder, "--class_labels",
                    ",".join(map(str, labels)), "--num_images", str(len(labels)), "--guidance_scale", str(scale),
                    "--scheduler", "ddim", "--seed", "1", "--batch_size", "100", "--device", "cpu", "--output", out],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    images = np.stack([np.asarray(Image.open(os.path.join(out, f"{i:06d}.png")))[..., None]
                       for i in range(len(labels))])
    return images, np.asarray(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--guidance_scales", default="2,3,4")
    parser.add_argument("--per_class", type=int, default=10)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "digits-conditional.yaml"))
    args = parser.parse_args()
    args.run_dir = os.path.abspath(args.run_dir)
    scorer = DigitScorer.for_recipe(args.config, [], 10 * args.per_class)
    print("| path | " + " | ".join(f"guidance {s}" for s in args.guidance_scales.split(",")) + " |")
    print("|---|" + "---|" * len(args.guidance_scales.split(",")))
    with tempfile.TemporaryDirectory() as work:
        paths = {"Hub-style load, pipeline's scheduler": lambda s: hub_style(args.run_dir, "own", s, args.per_class,
                                                                             work),
                 "Hub-style load, DDIM swapped in": lambda s: hub_style(args.run_dir, "ddim", s, args.per_class,
                                                                        work),
                 "python -m diffusion_extras.sample --scheduler ddim": lambda s: command_line(
                     args.run_dir, s, args.per_class, work)}
        for name, draw in paths.items():
            cells = []
            for scale in (float(s) for s in args.guidance_scales.split(",")):
                images, labels = draw(scale)
                cells.append(f"{float((scorer.predict(images) == labels).mean()):.3f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
