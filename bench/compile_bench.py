#!/usr/bin/env python
"""What --torch_compile costs and gains, on this machine: compile time, steady optimizer-step time
compiled against eager, the break-even step count, and the same for the sampling copy.

Both trainers are built in one process from the same recipe (training.build.build_run with one
accelerator) and timed in alternating rounds, so load from other processes falls on both alike:
the ratio is the figure to quote on a shared machine.

    OMP_NUM_THREADS=1 python bench/compile_bench.py --recipe digits
    python bench/compile_bench.py --recipe cifar10 --steps 6 --rounds 3

Training: the real `optimizer_step` (EMA, min-SNR, diagnostics, clipping, AdamW) on micro-batches
made beforehand. Compile time: the first compiled step minus a steady compiled step. Break-even:
compile time / (eager step - compiled step). Sampling: the run's SamplingCopy (eager, and compiled
with inductor) drawing --sample_images images with --sample_steps DDIM steps, twice: the first
compiled call pays the compile, the second is steady (same graphs: weights refreshed in place).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_step import full_step, make_config, write_synthetic_images  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=("digits", "cifar10"), default="digits")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps of each variant, in all")
    parser.add_argument("--rounds", type=int, default=6, help="alternating eager/compiled rounds")
    parser.add_argument("--sample_images", type=int, default=16)
    parser.add_argument("--sample_steps", type=int, default=20, help="DDIM steps per image")
    parser.add_argument("--json", help="results file (default: bench/results/compile-RECIPE.json)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def training_figures(args, eager_step, compiled_step) -> dict:
    eager_step()  # warm caches; the compiled first step is the compile
    first = timed(compiled_step)
    compiled_step()
    per_round = max(1, args.steps // args.rounds)
    times = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, step in (("eager", eager_step), ("compiled", compiled_step)):
            times[name].append(timed(lambda: [step() for _ in range(per_round)]) / per_round)  # noqa: B023
    eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
    compile_seconds = first - compiled
    gain = eager - compiled
    return {"eager_step_s": eager, "compiled_step_s": compiled, "speedup": eager / compiled,
            "compile_s": compile_seconds, "break_even_steps": compile_seconds / gain if gain > 0 else None}


def sampling_figures(args, run) -> dict:
    from diffusion_extras.evaluation import sampling
    from diffusion_extras.training.sampling_copy import SamplingCopy

    unet = run.accelerator.unwrap_model(run.learner.unet)
    scheduler = sampling.make_scheduler("ddim", run.objective.noise_scheduler.config)
    copies = {"eager": SamplingCopy(), "compiled": SamplingCopy({"backend": "inductor", "mode": None})}

    def draw(name):
        with copies[name](unet, run.extras.ema) as copy:
            return sampling.generate(copy, scheduler, args.sample_images, args.sample_steps, seed=0)
    first = timed(lambda: draw("compiled"))
    times = {"eager": [], "compiled": []}
    for _ in range(2):
        for name in times:
            times[name].append(timed(lambda: draw(name)))  # noqa: B023
    eager, compiled = min(times["eager"]), min(times["compiled"])
    gain = eager - compiled
    return {"images": args.sample_images, "ddim_steps": args.sample_steps, "eager_s": eager, "compiled_s": compiled,
            "speedup": eager / compiled, "compile_s": first - compiled,
            "break_even_evaluations": (first - compiled) / gain if gain > 0 else None}


def main(argv=None) -> int:
    from diffusion_extras.training import build

    args = parse_args(argv)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="compile_bench-") as workdir:
        bench_args = argparse.Namespace(tiny=args.tiny, recipe=args.recipe, mixed_precision=None, batch_size=None,
                                        snr_gamma=5.0)
        config = make_config(bench_args, ["--use_ema", "--no-torch_compile"], workdir)
        if args.recipe == "cifar10" and not args.tiny:
            write_synthetic_images(os.path.join(workdir, "images"), 4 * config.train_batch_size, config.resolution, 3)
        compiled_config = make_config(bench_args, ["--use_ema", "--torch_compile"], workdir)
        accelerator = build.start(config)
        eager_run = build.build_run(config, accelerator)
        compiled_run = build.build_run(compiled_config, accelerator)
        results = {"recipe": "tiny" if args.tiny else args.recipe, "threads": torch.get_num_threads(),
                   "images_per_step": config.train_batch_size * config.gradient_accumulation_steps,
                   "training": training_figures(args, full_step(eager_run), full_step(compiled_run)),
                   "sampling": sampling_figures(args, eager_run),
                   "load_average": {"start": load_start[0], "end": os.getloadavg()[0]}, "cpus": os.cpu_count(),
                   "command": " ".join(["python", "bench/compile_bench.py", *(argv or sys.argv[1:])]),
                   "torch": torch.__version__}
    print(json.dumps(results, indent=1, default=float))
    path = args.json or os.path.join(ROOT, "bench", "results", f"compile-{results['recipe']}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=float)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
