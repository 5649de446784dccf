"""How many CPU threads torch uses and how they wait, set by each command as it first imports torch.

torch's intra-op threads are OpenMP threads (GNU libgomp in the Linux wheels). With
OMP_WAIT_POLICY unset, libgomp has a thread that waits for its partner at the end of a parallel
region spin for up to 300,000 iterations before it sleeps. That is the fast choice when the CPUs
are the run's own, and a ruinous one when other work shares them: the spinning thread holds a core
its partner needs, and the default recipe ran 5 times slower beside one busy process than with one
thread. OMP_WAIT_POLICY=PASSIVE (threads sleep at once) is as fast as one thread there, but on an
idle machine each wake-up costs more than the spin it saves, and a run takes 1.5 times as long
(docs/BENCHMARKS.md, "CPU threads beside other work"). No spin count serves both.

So a command looks before torch loads: over a fifth of a second, how much of the machine's CPU
time other work takes (/proc/stat, while this process sleeps). If the CPUs left free are fewer
than the threads it will run, idle threads sleep (OMP_WAIT_POLICY=PASSIVE); otherwise they spin,
as torch's default has them. The wait policy changes no result, only the time. The user's choice
(OMP_WAIT_POLICY, or the runtimes' own GOMP_SPINCOUNT / KMP_BLOCKTIME) is kept and skips the look,
as does a single thread (nothing waits for a partner). The OpenMP runtime reads the policy once, as
torch loads: a program that imported torch before calling a command keeps its own.

The thread count: torch's default (its count of cores) at most the CPUs this process may use
(its affinity, and a cgroup CPU quota such as docker's --cpus, which torch ignores), shared among
the ranks of this machine (LOCAL_WORLD_SIZE) unless each is bound to CPUs of its own. A count the
user or a launcher set (OMP_NUM_THREADS: `accelerate launch` sets one unless told, torchrun with
several processes) or a program's own torch.set_num_threads before it called the command is kept.
The count is not taken from the load: it changes the order of floating-point sums, and a resumed
run must add as the first one did.
"""
from __future__ import annotations

import math
import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
# Variables by which a user chose how OpenMP threads wait: any of them set, the policy is theirs.
USER_WAIT_SETTINGS = (WAIT_POLICY, "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# ...and by which they chose the count, in torch's order: MKL_NUM_THREADS, when set, overrides
# OMP_NUM_THREADS (ATen's intraop_default_num_threads reads them so).
USER_COUNT_SETTINGS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")


PROBE_SECONDS = 0.2
# What set_wait_policy saw and chose as this process loaded torch (the OpenMP runtime keeps it for
# the process's life): (CPUs' worth of other work, whether idle threads sleep); None where it did not
# look (one thread, the user's policy, torch loaded already, no /proc/stat).
decision: tuple[float, bool] | None = None


def machine_cpu_times(path: str = "/proc/stat") -> tuple[int, int, int] | None:
    """(busy, total) clock ticks of all the machine's CPUs since boot and how many CPUs, from
    /proc/stat's first lines; None where there is none (not Linux). Busy: all but idle and iowait
    (time stolen by a hypervisor counts as busy: it was not free either)."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
        ticks = [int(v) for v in lines[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks), max(1, cpus)


def other_work_cpus(seconds: float = PROBE_SECONDS, read=None) -> float | None:
    """CPUs' worth of time the machine's other work takes now: the busy share of every CPU over
    `seconds` while this process sleeps (read: machine_cpu_times). None without /proc/stat."""
    import time
    read = read or machine_cpu_times
    first = read()
    if first is None:
        return None
    time.sleep(seconds)
    second = read()
    if second is None or second[1] <= first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * second[2]


def planned_threads(environ=os.environ) -> int:
    """The threads the command will run, before torch is loaded to say: the count the user or
    launcher set (user_thread_count), else the CPUs available shared among the machine's ranks
    (thread_count)."""
    given = user_thread_count(environ)
    return given[1] if given else thread_count(available_cpus(), environ)


def user_thread_count(environ=os.environ) -> tuple[str, int] | None:
    """("NAME=value", threads) of the variable torch takes its thread count from, or None where
    neither is set to a count (torch then counts the CPUs; so does thread_count)."""
    for name in USER_COUNT_SETTINGS:
        value = environ.get(name, "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return f"{name}={environ[name]}", int(value)
    return None


def threads_should_sleep(other_work: float, cpus: int, threads: int) -> bool:
    """Whether idle threads should sleep rather than spin: the CPUs other work leaves free are fewer
    than the threads (half a CPU of slack: a light daemon does not count)."""
    return cpus - other_work < threads - 0.5


def set_wait_policy(environ=os.environ, probe=None) -> bool:
    """Before torch is imported: OMP_WAIT_POLICY=PASSIVE in `environ` when the CPUs that other work
    leaves free (probe(), other_work_cpus: CPUs' worth it takes, of os.cpu_count()) are fewer than
    the threads the command will run (threads_should_sleep); otherwise idle threads keep torch's
    default spin. Nothing is looked at or set when the user chose a wait policy, the command runs
    one thread, or torch is loaded already (too late). Returns whether it set PASSIVE."""
    global decision
    if "torch" in sys.modules or any(name in environ for name in USER_WAIT_SETTINGS):
        return False
    threads = planned_threads(environ)
    if threads <= 1:
        return False
    busy = (probe or other_work_cpus)()
    if busy is None:
        return False
    passive = threads_should_sleep(busy, os.cpu_count() or 1, threads)
    decision = (busy, passive)
    if passive:
        environ[WAIT_POLICY] = "PASSIVE"
    return passive


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
    user or the launcher gave one (OMP_NUM_THREADS, MKL_NUM_THREADS). A variable set to no count
    (OMP_NUM_THREADS=abc, or 0) is not a choice: torch warns, ignores it and counts the cores, and
    this shares them as if it were unset, the count planned_threads planned and describe states."""
    if user_thread_count(environ) is not None:
        return
    import torch
    count = thread_count(torch.get_num_threads(), environ)
    if count != torch.get_num_threads():
        torch.set_num_threads(count)


def describe(environ=os.environ) -> str:
    """The start-up line: how many threads torch uses, where the count comes from, how idle ones wait."""
    import torch
    count = torch.get_num_threads()
    given = user_thread_count(environ)
    source = given[0] if given else f"of {available_cpus()} CPU(s) available; OMP_NUM_THREADS sets another"
    chosen = [f"{name}={environ[name]}" for name in USER_WAIT_SETTINGS if name in environ]
    if count == 1:
        waiting = ""
    elif decision is not None and decision[1]:
        waiting = (f", idle ones sleep (OMP_WAIT_POLICY=PASSIVE: other work took {decision[0]:.1f} of the "
                   f"{os.cpu_count()} CPU(s) at start)")
    elif decision is not None:
        waiting = (", idle ones spin (the CPUs were free at start; if other work will share them, "
                   "OMP_WAIT_POLICY=PASSIVE keeps this run's speed)")
    elif chosen:
        waiting = f", idle ones wait as {chosen[0]} says"
    else:
        waiting = ", idle ones spin (torch's default: the command did not look at the CPUs' load)"
    return f"cpu: {count} torch thread(s) per process ({source}){waiting}"
