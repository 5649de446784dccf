#!/usr/bin/env python
"""Two nodes against one, on the local two-node Slurm cluster: what the multi-node example
(examples/slurm/train_multi_node.sbatch) costs and does when its ranks are on different nodes.

    bash examples/slurm/local_cluster.sh --nodes 2
    python bench/two_nodes.py [--steps 200] [--repeats 3]

1. round trip: one all-reduce (max) of a one-element CPU tensor on gloo, what the ranks' stop
   agreement costs each step (training/preemption.py): between node1 and node2, and between two
   ranks of one node; the median and 90th percentile of 2,000, in microseconds.
2. training: the digits default for --steps optimizer steps (one checkpoint, at the end), submitted
   as users submit it on 2 nodes x 1 rank and on 1 node x 2 ranks (the same global batch): the job's
   wall time, the median images/s of the steps after the 10th, and whether the checkpoints' state
   files differ (none should).
3. lost node: the same 2-node job with a checkpoint every --steps/4 steps, its rank on node2 killed
   (SIGKILL) once the first checkpoint is written: seconds from the kill to the job leaving the queue,
   and srun's line naming the lost task.
4. vanished node: that job again, node2's link cut instead once the first checkpoint is written:
   seconds until Slurm requeues the job (node2 declared down: local_cluster.sh's SlurmdTimeout) and
   until node1's rank has ended (KillWait); then the link restored and the requeue's 2-minute hold
   released, as an admin would: seconds until the job ends, and its state.
Every job runs this checkout with this interpreter (the example's PYTHON). The local cluster's nodes
share this machine's cores: the two layouts differ in the path between the ranks (a bridge between
network namespaces against loopback), not in compute. Prints one JSON line per measurement, with
the load average.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "slurm", "train_multi_node.sbatch")
LAYOUTS = {"2 nodes x 1 rank": ("--nodes=2", "--ntasks-per-node=1"),
           "1 node x 2 ranks": ("--nodes=1", "--ntasks-per-node=2")}
# The example's GPU and CPU counts overridden as on a CPU cluster (a local node has this machine's cores)
CPU_JOB = ("--gpus-per-node=0", "--cpus-per-task=1", "--time=60")
MEASURES = ("round_trip", "training", "lost", "vanished")


def environment() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "PYTHON": sys.executable}


def wait_for_job(job_id: str) -> str:
    """The job's final state once it has left the queue."""
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)
    state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return state.split("JobState=")[1].split()[0] if "JobState=" in state else "GONE"


def round_trip(layout: str, repeats: int) -> dict:
    """srun's ranks in `layout` time the all-reduce; rank 0 prints its figures."""
    port = 20000 + os.getpid() % 20000
    command = ["srun", *LAYOUTS[layout], "--cpus-per-task=1", "bash", "-c",
               f'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_PORT={port} '
               f'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '
               f'exec "$PYTHON" {__file__} --probe {repeats}']
    result = subprocess.run(command, capture_output=True, text=True, env=environment(), cwd=ROOT, check=True)
    return {"measure": "round trip", "layout": layout, **json.loads(result.stdout.strip().splitlines()[-1])}


def probe(repeats: int) -> None:
    """In each rank: `repeats` timed all-reduces after 200 untimed ones."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    flag, times = torch.zeros(1, dtype=torch.int32), []
    for index in range(200 + repeats):
        start = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if index >= 200:
            times.append((time.perf_counter() - start) * 1e6)
    if dist.get_rank() == 0:
        times.sort()
        print(json.dumps({"median_us": round(statistics.median(times), 1),
                          "p90_us": round(times[int(0.9 * len(times))], 1)}))
    dist.destroy_process_group()


def submit(layout: str, work: str, name: str, *flags) -> tuple[str, str, str]:
    """The example in `layout` on the digits default; (job id, output folder, log)."""
    out, log = os.path.join(work, name), os.path.join(work, f"{name}.out")
    job_id = subprocess.check_output(["sbatch", "--parsable", *LAYOUTS[layout], *CPU_JOB, f"--output={log}",
                                      EXAMPLE, "--output_dir", out, "--logger", "none", *flags],
                                     cwd=ROOT, env=environment(), text=True).strip().split(";")[0]
    return job_id, out, log


def training(layout: str, steps: int, work: str) -> dict:
    name = layout.replace(" ", "")
    started = time.monotonic()
    job_id, out, _ = submit(layout, work, name, "--max_train_steps", str(steps), "--checkpointing_steps", str(steps))
    state = wait_for_job(job_id)
    wall = time.monotonic() - started
    with open(os.path.join(out, "logs", "history.jsonl")) as fh:
        rates = [row["images_per_second"] for row in map(json.loads, fh) if row.get("step", 0) > 10
                 and "images_per_second" in row]
    return {"measure": "training", "layout": layout, "state": state, "steps": steps, "job_wall_s": round(wall, 1),
            "median_images_per_s": round(statistics.median(rates), 1),
            "checkpoint": os.path.join(out, f"checkpoint-{steps}")}


def state_differences(a: str, b: str) -> list[str]:
    """The files of checkpoint folder `a` or `b` that the other lacks or holds with other bytes, but
    train_state.json (it records the output folder) and the marker (that file's checksum)."""
    names = [set(os.listdir(folder)) - {"train_state.json", "checkpoint_complete.json"} for folder in (a, b)]
    return sorted((names[0] ^ names[1]) | {name for name in names[0] & names[1] if not filecmp.cmp(
        os.path.join(a, name), os.path.join(b, name), shallow=False)})


def trainer_process(job_id: str, rank: int) -> int:
    """The pid of rank `rank`'s trainer in the job: the Python process srun's step started with that
    SLURM_PROCID (its parent is slurmstepd; its loader workers' parent is the trainer; the batch
    script, also slurmstepd's child with SLURM_PROCID=0, is a shell)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = set(fh.read().split(b"\0"))
            with open(f"/proc/{pid}/stat") as fh:
                parent = fh.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{parent}/comm") as fh:
                parent_name = fh.read().strip()
            program = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if ({f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()} <= environ
                and parent_name == "slurmstepd" and program.startswith("python")):
            found.append(int(pid))
    if len(found) != 1:
        raise RuntimeError(f"rank {rank} of job {job_id}: {found} processes")
    return found[0]


def past_first_checkpoint(name: str, steps: int, work: str) -> tuple[str, str, str]:
    """The 2-node job with a checkpoint every steps/4 steps, once its first is written: (job id,
    output folder, log)."""
    every = max(1, steps // 4)
    job_id, out, log = submit("2 nodes x 1 rank", work, name, "--max_train_steps", str(steps),
                              "--checkpointing_steps", str(every))
    while not os.path.isdir(os.path.join(out, f"checkpoint-{every}")):
        time.sleep(0.1)
    return job_id, out, log


def lost_node(steps: int, work: str) -> dict:
    job_id, _, log = past_first_checkpoint("lost", steps, work)
    os.kill(trainer_process(job_id, 1), signal.SIGKILL)
    killed = time.monotonic()
    state = wait_for_job(job_id)
    with open(log, errors="replace") as fh:
        lines = [line for line in fh.read().replace("\r", "\n").splitlines() if line.startswith("srun: error:")]
    return {"measure": "lost node", "state": state, "kill_to_job_end_s": round(time.monotonic() - killed, 1),
            "srun_lines": lines}


def set_node_link(node: int, state: str) -> None:
    """The machine's end of node `node`'s veth pair (local_cluster.sh) up or down: down, the node's
    slurmd and ranks reach nothing and nothing reaches them, and no connection is closed."""
    subprocess.run(["ip", "link", "set", f"veth-node{node}", state], check=True)


def job_restarts(job_id: str) -> int:
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return int(text.split(" Restarts=")[1].split()[0]) if " Restarts=" in text else 0


def vanished_node(steps: int, work: str) -> dict:
    job_id, _, _ = past_first_checkpoint("vanished", steps, work)
    first = trainer_process(job_id, 0)
    set_node_link(2, "down")
    cut = time.monotonic()
    try:
        while job_restarts(job_id) == 0:
            time.sleep(0.2)
        requeued = time.monotonic() - cut
        while os.path.exists(f"/proc/{first}"):
            time.sleep(0.2)
        ended = time.monotonic() - cut
    finally:
        set_node_link(2, "up")
    restored = time.monotonic()
    while subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True,
                         text=True).stdout.strip() not in ("BeginTime", ""):
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
    state = wait_for_job(job_id)
    return {"measure": "vanished node", "state": state, "cut_to_requeue_s": round(requeued, 1),
            "cut_to_node1_rank_ended_s": round(ended, 1), "restore_to_job_end_s": round(time.monotonic() - restored, 1)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each training job")
    parser.add_argument("--repeats", type=int, default=2000, help="all-reduces timed per round trip")
    parser.add_argument("--only", choices=MEASURES, help="one measurement (numbered in the docstring); default: all")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # inside a rank (round_trip)
    args = parser.parse_args(argv)
    if args.probe:
        return probe(args.probe)
    def report(row: dict) -> None:
        print(json.dumps({**row, "load_average": os.getloadavg()[0]}), flush=True)

    wanted = {args.only} if args.only else set(MEASURES)
    if "round_trip" in wanted:
        for layout in LAYOUTS:
            report(round_trip(layout, args.repeats))
    with tempfile.TemporaryDirectory(prefix="two-nodes-") as work:
        if "training" in wanted:
            checkpoints = []
            for layout in LAYOUTS:
                run = training(layout, args.steps, work)
                checkpoints.append(run.pop("checkpoint"))
                report(run)
            report({"measure": "training", "differing_state_files": state_differences(*checkpoints)})
        if "lost" in wanted:
            report(lost_node(args.steps, work))
        if "vanished" in wanted:
            report(vanished_node(args.steps, work))
    print(json.dumps({"command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
