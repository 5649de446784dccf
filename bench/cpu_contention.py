"""Training speed on a CPU that other work shares, and on a quiet one: `python train_ddpm.py` (the
default recipe) for a few steps, as a user's shell runs it (no OMP_* variable set), timed from the
command's start to its exit.

    # beside one busy process (a Python loop on one core): as shipped vs OMP_NUM_THREADS=1 (target <= 1.3x)
    python bench/cpu_contention.py --busy 1
    # a quiet machine: this tree vs an earlier commit's, alternating (target: no slower)
    python bench/cpu_contention.py --busy 0 --baseline_ref COMMIT

Each variant runs --repeats times, alternating with the other, so a drift of the machine's speed
hits both; the table gives each run's wall time and the training loop's images/s (logs/history.jsonl),
and the ratio of the medians. The machine, its load average before and after and the command go
with the figures into --json. The baseline is the commit's tree (`git archive`), run with its own
train_ddpm.py and package. What the trainer said about its threads (its "cpu:" line) is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_report import ROOT, command_line

# What a user's shell may set that changes how torch's threads run: removed for every variant, so
# "as shipped" is a plain shell; a variant sets its own.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# One core's worth of Python loop that ends with this script, however it ends (a killed script runs no finally)
BUSY_LOOP = ("import os\nparent = os.getppid()\n"
             "while os.getppid() == parent:\n    for _ in range(10 ** 6):\n        pass")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=1,
                        help="busy processes (one core each) beside the runs (default: %(default)s)")
    parser.add_argument("--baseline_ref", default=None,
                        help="a commit to compare with (its tree, as shipped); without it: as shipped vs "
                             "OMP_NUM_THREADS=1")
    parser.add_argument("--steps", type=int, default=20,
                        help="optimizer steps per run (--max_train_steps) (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, alternating (default: %(default)s)")
    parser.add_argument("--target", type=float, default=None,
                        help="the ratio (first variant / second) to meet; default 1.3 beside busy processes "
                             "vs OMP_NUM_THREADS=1, 1.0 against a baseline commit")
    parser.add_argument("--json", default=None, help="where to write the figures; default "
                                                     "bench/results/cpu_contention-busy<N>[-vs-<ref>].json")
    return parser.parse_args(argv)


def baseline_tree(ref: str, folder: str) -> str:
    """The tree of commit `ref` extracted into `folder`; returns it."""
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    os.makedirs(folder)
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def time_run(tree: str, extra_env: dict, steps: int, output_dir: str) -> dict:
    """`python train_ddpm.py` of `tree` for `steps` steps into a fresh `output_dir`: wall seconds, the
    loop's images/s and the trainer's "cpu:" line."""
    env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}
    env.update(PYTHONPATH=tree, HF_HUB_OFFLINE="1", **extra_env)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "train_ddpm.py", "--output_dir", output_dir, "--max_train_steps",
                             str(steps), "--logger", "none"], cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"the run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    history = os.path.join(output_dir, "logs", "history.jsonl")
    with open(history) as fh:
        rates = [json.loads(line)["images_per_second"] for line in fh if "images_per_second" in line]
    cpu_line = next((line for line in result.stdout.splitlines() if line.startswith("cpu: ")), None)
    return {"seconds": seconds, "images_per_second": rates, "cpu_line": cpu_line}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline_ref:
        names = ("this tree", f"{args.baseline_ref}'s tree")
    else:
        names = ("as shipped", "OMP_NUM_THREADS=1")
    target = args.target if args.target is not None else (1.0 if args.baseline_ref else 1.3)
    load_start = os.getloadavg()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
    runs = {name: [] for name in names}
    try:
        with tempfile.TemporaryDirectory(prefix="cpu-contention-") as scratch:
            trees = {names[0]: ROOT, names[1]: ROOT}
            envs = {names[0]: {}, names[1]: {} if args.baseline_ref else {"OMP_NUM_THREADS": "1"}}
            if args.baseline_ref:
                trees[names[1]] = baseline_tree(args.baseline_ref, os.path.join(scratch, "baseline"))
            for repeat in range(args.repeats):
                order = names if repeat % 2 == 0 else names[::-1]
                for name in order:
                    output = os.path.join(scratch, f"run-{len(runs[name])}-{names.index(name)}")
                    runs[name].append(time_run(trees[name], envs[name], args.steps, output))
                    print(f"{name}: {runs[name][-1]['seconds']:.1f} s", flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    medians = {name: statistics.median(run["seconds"] for run in runs[name]) for name in names}
    ratio = medians[names[0]] / medians[names[1]]
    results = {"command": command_line(__file__, sys.argv[1:] if argv is None else argv),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
               "cpus_available": len(os.sched_getaffinity(0)), "busy_processes": args.busy,
               "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
               "steps": args.steps, "runs": runs, "median_seconds": medians, "ratio": ratio, "target": target,
               "meets_target": ratio <= target}
    path = args.json or os.path.join(ROOT, "bench", "results", f"cpu_contention-busy{args.busy}"
                                     + (f"-vs-{args.baseline_ref}" if args.baseline_ref else "") + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"\n{args.steps} steps of the default recipe beside {args.busy} busy process(es), "
          f"{os.cpu_count()} CPUs, load average {load_start[0]:.2f} before")
    print("| variant | wall s per run | median | loop img/s (last window) | cpu line |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        walls = ", ".join(f"{run['seconds']:.1f}" for run in runs[name])
        rates = ", ".join(f"{run['images_per_second'][-1]:.0f}" if run["images_per_second"] else "-"
                          for run in runs[name])
        print(f"| {name} | {walls} | {medians[name]:.1f} | {rates} | {runs[name][0]['cpu_line']} |")
    print(f"\nratio {names[0]} / {names[1]}: {ratio:.2f} (target <= {target:g}: "
          f"{'met' if ratio <= target else 'MISSED'}); written to {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
