#!/usr/bin/env python
"""What an optimizer step launches from Python: the ATen ops dispatched at top level outside
compiled regions, and the compiled regions entered, per step, counted with torch.profiler on CPU.

On a GPU each such op is a kernel launch paid in Python; the compiled regions are where
`torch.compile` fused them. The count does not depend on the machine's load, so it is the figure
to guard (tests/test_step_ops.py); the time a launch costs is the GPU's to measure.

    python bench/step_ops.py --recipe digits                      # eager, then --torch_compile
    python bench/step_ops.py --recipe digits --backend aot_eager  # same graphs, no code generation
    python bench/step_ops.py --recipe digits --backend aot_eager --json dit.json -- --model_type dit
                                                                  # trainer flags after --

Both trainers are built from the recipe (EMA, min-SNR 5, diagnostics, clipping, AdamW) and run
the real `optimizer_step` on micro-batches made beforehand: --warmup steps first (steps 1-5:
compilation and the optimizer's lazy state), then --steps profiled ones (steps 6-11).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

# record_function names of compiled code: a dynamo frame's call and its autograd backward (an
# aot_autograd graph); whatever runs under them is the compiled region's, not a launch from Python
COMPILED_REGIONS = ("Torch-Compiled Region", "CompiledFunction")


def is_compiled_region(name: str) -> bool:
    return name.startswith(COMPILED_REGIONS)


def top_level_ops(events) -> tuple[collections.Counter, int]:
    """(ATen ops at top level outside compiled regions by name, compiled regions entered) of a
    profile's events. An op inside another ATen op or inside a compiled region is not counted; a
    compiled region inside another (a backward's nested calls) counts once."""
    ops, regions = collections.Counter(), 0
    for event in events:
        name, parent, nested = event.name, event.cpu_parent, False
        while parent is not None and not nested:
            nested = parent.name.startswith("aten::") or is_compiled_region(parent.name)
            parent = parent.cpu_parent
        if nested:
            continue
        if name.startswith("aten::"):
            ops[name] += 1
        elif is_compiled_region(name):
            regions += 1
    return ops, regions


def profile_steps(step, steps: int) -> dict:
    """Per-step figures of `steps` calls of `step()` under torch.profiler (CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops, regions = top_level_ops(prof.events())
    return {"ops_per_step": sum(ops.values()) / steps, "compiled_regions_per_step": regions / steps,
            "ops": {name: count / steps for name, count in ops.most_common()}}


def parse_args(argv=None):
    """(the bench's arguments, the trainer flags given after --)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] [-- TRAINER FLAGS]")
    parser.add_argument("--recipe", choices=("digits", "cifar10"), default="digits")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                        help="--torch_compile_backend of the compiled trainer")
    parser.add_argument("--warmup", type=int, default=5, help="unprofiled steps first (compilation happens here)")
    parser.add_argument("--steps", type=int, default=6, help="profiled optimizer steps")
    parser.add_argument("--json", help="results file (default: bench/results/step-ops-RECIPE.json)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv[:split])
    if args.steps < 1 or args.warmup < 2:
        parser.error("--steps must be at least 1 and --warmup at least 2 (the first compiled steps compile)")
    return args, argv[split + 1:]


def main(argv=None) -> int:
    from bench_step import full_step, make_config, write_synthetic_images

    from diffusion_extras.training import build

    args, trainer_flags = parse_args(argv)
    results = {"recipe": "tiny" if args.tiny else args.recipe, "backend": args.backend,
               "command": " ".join(["python", "bench/step_ops.py", *(argv if argv is not None else sys.argv[1:])]),
               "trainer_flags": trainer_flags, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="step_ops-") as workdir:
        bench_args = argparse.Namespace(tiny=args.tiny, recipe=args.recipe, mixed_precision=None, batch_size=None,
                                        snr_gamma=5.0)
        variants = {"eager": ["--no-torch_compile"],
                    "compiled": ["--torch_compile", "--torch_compile_backend", args.backend]}
        accelerator = None
        for name, flags in variants.items():
            config = make_config(bench_args, ["--use_ema", *flags, *trainer_flags], workdir)
            if args.recipe == "cifar10" and not args.tiny and name == "eager":
                write_synthetic_images(os.path.join(workdir, "images"), 4 * config.train_batch_size,
                                       config.resolution, 3)
            accelerator = accelerator or build.start(config)
            step = full_step(build.build_run(config, accelerator))
            for _ in range(args.warmup):
                step()
            results[name] = profile_steps(step, args.steps)
    print(json.dumps(results, indent=1))
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"step-ops-{results['recipe']}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
