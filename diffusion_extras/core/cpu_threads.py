"""How many CPU threads torch uses and how they wait, set by each command as it first imports torch.

torch's intra-op threads are OpenMP threads (GNU libgomp in the Linux wheels). With
OMP_WAIT_POLICY unset, libgomp has a thread that waits for its partner at the end of a parallel
region spin for up to 300,000 iterations before it sleeps. On a CPU that other work shares, the
partner has often lost its core, and the spinning thread burns its own time slice waiting for it:
the default recipe ran several times slower beside one busy process than with one thread, and
faster than one thread with OMP_WAIT_POLICY=PASSIVE, where threads sleep at once
(docs/BENCHMARKS.md, "CPU threads beside other work"). So a command sets OMP_WAIT_POLICY=PASSIVE
before torch loads, unless the user chose a wait policy (OMP_WAIT_POLICY, or the runtimes' own
GOMP_SPINCOUNT / KMP_BLOCKTIME). The OpenMP runtime reads it once, as torch loads: a program that
imported torch before calling a command keeps its own.

The thread count: torch's default (its count of cores) at most the CPUs this process may use
(its affinity, and a cgroup CPU quota such as docker's --cpus, which torch ignores), shared among
the ranks of this machine (LOCAL_WORLD_SIZE) unless each is bound to CPUs of its own. A count the
user or a launcher set (OMP_NUM_THREADS: `accelerate launch` sets one unless told, torchrun with
several processes) or a program's own torch.set_num_threads before it called the command is kept.
Not from the load average: a reading at start-up says little about hours of training beside other
work, and passive waiting makes the extra threads cheap there.
"""
from __future__ import annotations

import math
import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
# Variables by which a user chose how OpenMP threads wait: any of them set, the policy is theirs.
USER_WAIT_SETTINGS = (WAIT_POLICY, "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
USER_COUNT_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def set_wait_policy(environ=os.environ) -> bool:
    """Before torch is imported: OMP_WAIT_POLICY=PASSIVE in `environ` unless the user chose a wait
    policy or torch is loaded already (too late). Returns whether it set it."""
    if "torch" in sys.modules or any(name in environ for name in USER_WAIT_SETTINGS):
        return False
    environ[WAIT_POLICY] = "PASSIVE"
    return True


def available_cpus() -> int:
    """CPUs this process may run on: its affinity (taskset, Slurm's binding, a cpuset), at most its
    cgroup's CPU quota rounded up."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(count, math.ceil(quota))) if quota else count


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the process's cgroup may use (cgroup v2 cpu.max, v1 cfs quota), None without a limit."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            with open(os.path.join(root, quota_file)) as fh:
                fields = fh.read().split()
            if period_file is not None:
                with open(os.path.join(root, period_file)) as fh:
                    fields.append(fh.read().strip())
            quota, period = fields[0], fields[1]
            if quota in ("max", "-1"):
                return None
            return int(quota) / int(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def bound_to_some_cpus() -> bool:
    """Whether the process may run on fewer than all of the machine's CPUs (taskset, Slurm's
    --cpu-bind): then they are its own, not shared with the machine's other ranks."""
    return hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)


def thread_count(torch_default: int, environ=os.environ) -> int:
    """Threads per process: torch's default, at most the CPUs available, shared among the machine's
    ranks (LOCAL_WORLD_SIZE) unless the process is bound to CPUs of its own."""
    local_ranks = 1 if bound_to_some_cpus() else max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, min(torch_default, available_cpus()) // local_ranks)


def set_thread_count(environ=os.environ) -> None:
    """Once torch is imported by the command itself: its thread count (thread_count), unless the
    user or the launcher gave one (OMP_NUM_THREADS, MKL_NUM_THREADS)."""
    if any(name in environ for name in USER_COUNT_SETTINGS):
        return
    import torch
    count = thread_count(torch.get_num_threads(), environ)
    if count != torch.get_num_threads():
        torch.set_num_threads(count)


def describe(environ=os.environ) -> str:
    """The start-up line: how many threads torch uses, where the count comes from, how idle ones wait."""
    import torch
    count = torch.get_num_threads()
    given = [f"{name}={environ[name]}" for name in USER_COUNT_SETTINGS if name in environ]
    source = given[0] if given else f"of {available_cpus()} CPU(s) available; OMP_NUM_THREADS sets another"
    policy = environ.get(WAIT_POLICY, "").upper()
    if count == 1:
        waiting = ""
    elif policy == "PASSIVE":
        waiting = ", idle ones sleep (OMP_WAIT_POLICY=PASSIVE)"
    else:
        chosen = [f"{name}={environ[name]}" for name in USER_WAIT_SETTINGS if name in environ]
        waiting = (f", idle ones wait as {chosen[0]} says" if chosen else
                   ", idle ones spin (torch was loaded before the command could set OMP_WAIT_POLICY=PASSIVE: "
                   "slow beside other work)")
    return f"cpu: {count} torch thread(s) per process ({source}){waiting}"
