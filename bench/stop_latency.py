#!/usr/bin/env python
"""How long a preemption stop takes: the digits default recipe with loader workers,
a stop signal to the whole process group (as Slurm and a terminal send it) a few seconds into
training, and the times to the "preempted:" line and to the process's exit.

    python bench/stop_latency.py [--signal SIGUSR1] [--workers 2] [--repeats 3] [--after 3]

Each repeat is a fresh run in its own process group, signalled `--after` seconds after its first
optimizer step is logged (so mid-training, not in start-up). Prints one JSON line per repeat and
the medians; the exit code of every run must be 4.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_stop(signal_name: str, workers: int, after: float, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "run")
        command = [sys.executable, os.path.join(ROOT, "train_ddpm.py"), "--output_dir", out,
                   "--dataloader_num_workers", str(workers), "--max_train_steps", "100000",
                   "--checkpointing_steps", "100000", "--logger", "none", *extra]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                "PYTHONUNBUFFERED": "1"})
        history = os.path.join(out, "logs", "history.jsonl")
        while not (os.path.exists(history) and os.path.getsize(history)):
            if process.poll() is not None:
                raise SystemExit(f"training ended before its first step: {process.stdout.read()[-2000:]}")
            time.sleep(0.05)
        time.sleep(after)
        os.killpg(process.pid, getattr(signal, signal_name))
        sent = time.monotonic()
        line_at = None
        buffer = ""
        while True:  # tqdm writes \r-separated updates: read characters, not lines
            chunk = process.stdout.read(1)
            if not chunk:
                break
            buffer += chunk
            if line_at is None and "preempted: " in buffer[-400:]:
                line_at = time.monotonic() - sent
        process.wait()
        exited = time.monotonic() - sent
        stop_line = next((part for part in buffer.splitlines() if part.startswith("preempted: ")), "")
        return {"signal": signal_name, "workers": workers, "exit_code": process.returncode,
                "stop_line_s": round(line_at, 2) if line_at is not None else None, "exit_s": round(exited, 2),
                "step": int(stop_line.split("optimizer step ")[1].split()[0]) if stop_line else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signal", default="SIGUSR1", choices=["SIGTERM", "SIGUSR1", "SIGINT"])
    parser.add_argument("--workers", type=int, default=2, help="--dataloader_num_workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--after", type=float, default=3.0, help="seconds after the first logged step")
    args, extra = parser.parse_known_args(argv)  # unknown flags go to train_ddpm.py
    rows = []
    for _ in range(args.repeats):
        rows.append(one_stop(args.signal, args.workers, args.after, extra))
        print(json.dumps(rows[-1]), flush=True)
    if any(row["exit_code"] != 4 for row in rows):
        raise SystemExit("a run did not exit 4 (preempted with a checkpoint)")
    print(json.dumps({"median_stop_line_s": statistics.median(r["stop_line_s"] for r in rows),
                      "median_exit_s": statistics.median(r["exit_s"] for r in rows),
                      "load_average": os.getloadavg()[0], "command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
