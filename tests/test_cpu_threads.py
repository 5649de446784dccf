"""torch's CPU threads in a command (core/cpu_threads.py, through commands.importing_the_stack): idle
threads sleep (OMP_WAIT_POLICY=PASSIVE, as the OpenMP runtime reads it when torch loads) where other
work takes the CPUs they need and spin where the CPUs are free, unless the user chose how they wait;
as many as the CPUs the process may use, shared among a machine's ranks, unless the user or the
launcher chose; a program that imported torch first keeps its own; the trainer's start-up line says
what it uses. Import-time settings: each case is a process of its own."""
import json
import os
import subprocess
import sys

import pytest
from helpers import run_training

from diffusion_extras.core import commands, cpu_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A command's import of torch, as `train_ddpm.py` and the other commands make it; prints what it got.
COMMAND_IMPORT = """
import json, os, sys
from diffusion_extras.core import commands, cpu_threads
if len(sys.argv) > 1:  # the CPUs' worth of other work the look before torch loads sees
    cpu_threads.other_work_cpus = lambda: float(sys.argv[1])
with commands.leaving_the_process_as_found(record_stop_signals=False):
    with commands.importing_the_stack():
        import torch
    inside = os.environ.get("OMP_WAIT_POLICY")
    line = cpu_threads.describe()
print(json.dumps({"inside": inside, "after": os.environ.get("OMP_WAIT_POLICY"), "threads": torch.get_num_threads(),
                  "line": line}))
"""


def run_python(code: str, *args, **env) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` with the test process's environment less any thread setting, plus `env`;
    OMP_DISPLAY_ENV makes the OpenMP runtime print the settings it read when torch loaded it."""
    base = {name: value for name, value in os.environ.items()
            if name not in (*cpu_threads.USER_WAIT_SETTINGS, *cpu_threads.USER_COUNT_SETTINGS)}
    base.update(PYTHONPATH=ROOT, OMP_DISPLAY_ENV="VERBOSE", **env)
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=base, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def command(*other_work, **env) -> tuple[dict, str | None]:
    """(what COMMAND_IMPORT printed, given the CPUs' worth of other work it sees if any, how long GNU
    libgomp, the OpenMP runtime of torch's Linux wheels, has an idle thread spin as it displayed it;
    None under another runtime). libgomp's default (OMP_WAIT_POLICY unset) is 300000 spins; PASSIVE 0."""
    result = run_python(COMMAND_IMPORT, *other_work, **env)
    spin = [line.split("=")[1].strip().strip("'") for line in result.stderr.splitlines()
            if line.strip().startswith("GOMP_SPINCOUNT =")]
    return json.loads(result.stdout.splitlines()[-1]), spin[0] if spin else None


def torch_default_threads() -> int:
    return int(run_python("import torch; print(torch.get_num_threads())").stdout.split()[-1])


def test_idle_threads_sleep_where_other_work_takes_the_cpus_they_need_and_the_variable_is_left_as_found():
    cpus = os.cpu_count()
    got, spin = command(cpus - 1, OMP_NUM_THREADS="2")  # one CPU left free for two threads
    assert spin in ("0", None)  # what torch's OpenMP runtime read as it loaded
    assert got["inside"] == "PASSIVE" and got["after"] is None
    assert got["line"] == (f"cpu: 2 torch thread(s) per process (OMP_NUM_THREADS=2), idle ones sleep "
                           f"(OMP_WAIT_POLICY=PASSIVE: other work took {cpus - 1:.1f} of the {cpus} CPU(s) at start)")


def test_idle_threads_spin_where_the_cpus_are_free():
    got, spin = command(0.1, OMP_NUM_THREADS="2")
    assert spin in ("300000", None) and got["inside"] is None and got["after"] is None
    assert "idle ones spin (the CPUs were free at start; if other work will share them, OMP_WAIT_POLICY=PASSIVE" \
        in got["line"]


def test_the_line_names_the_cpus_available_when_no_one_set_the_count():
    got, _ = command()
    assert got["line"].startswith(f"cpu: {got['threads']} torch thread(s) per process (of "
                                  f"{cpu_threads.available_cpus()} CPU(s) available")


@pytest.mark.parametrize("other_work, cpus, threads, sleep", [
    (0.05, 2, 2, False), (0.4, 2, 2, False), (0.6, 2, 2, True), (1.0, 2, 2, True),  # one busy process on 2 CPUs
    (1.0, 16, 8, False), (9.0, 16, 8, True), (15.0, 16, 16, True), (0.0, 4, 4, False)])
def test_threads_sleep_when_the_free_cpus_are_fewer_than_the_threads(other_work, cpus, threads, sleep):
    assert cpu_threads.threads_should_sleep(other_work, cpus, threads) is sleep


def test_other_work_is_the_busy_share_of_every_cpu_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    # cpu  user nice system idle iowait irq softirq steal (guest fields after are ignored)
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\ncpu1 50 0 25 400 25 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    assert cpu_threads.machine_cpu_times(str(stat)) == (150, 1000, 2)
    assert cpu_threads.machine_cpu_times(str(tmp_path / "absent")) is None
    readings = iter([(150, 1000, 2), (150 + 75, 1000 + 100, 2)])  # 75 of 100 ticks busy, on 2 CPUs
    assert cpu_threads.other_work_cpus(0, read=lambda: next(readings)) == 1.5
    assert cpu_threads.other_work_cpus(0, read=lambda: None) is None
    # on this machine, while the test sleeps: a figure between none and every CPU
    assert 0 <= cpu_threads.other_work_cpus(0.05) <= os.cpu_count() + 1e-9


@pytest.mark.parametrize("setting, spins", [({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),
                                            ({"GOMP_SPINCOUNT": "1000"}, "1000")])
def test_a_users_wait_policy_is_kept(setting, spins):
    got, spin = command(**setting)
    assert spin in (spins, None)
    assert got["inside"] == setting.get("OMP_WAIT_POLICY")


def test_the_threads_are_shared_among_a_machines_ranks_unless_the_user_or_launcher_set_them():
    default = torch_default_threads()
    got, _ = command(LOCAL_WORLD_SIZE="2")
    shared = 1 if cpu_threads.bound_to_some_cpus() else 2  # a process bound to CPUs of its own has them
    assert got["threads"] == max(1, min(default, cpu_threads.available_cpus()) // shared)
    if default > 1 and shared == 2:  # a machine of one CPU cannot tell
        assert got["threads"] < default
    got, _ = command(LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS=str(default))
    assert got["threads"] == default and f"(OMP_NUM_THREADS={default})" in got["line"]


def test_a_program_that_imported_torch_first_keeps_its_threads():
    import torch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with commands.leaving_the_process_as_found(record_stop_signals=False), commands.importing_the_stack():
            assert "OMP_WAIT_POLICY" not in os.environ
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5), ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None)])
def test_a_cgroup_cpu_quota_is_read_from_cgroup_v2_and_v1(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_threads.cgroup_cpu_quota(str(tmp_path)) == quota


def test_the_count_is_capped_by_the_cpus_available_and_shared_unless_bound(monkeypatch):
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 8)
    monkeypatch.setattr(cpu_threads, "bound_to_some_cpus", lambda: False)
    assert cpu_threads.thread_count(16, {}) == 8  # docker --cpus 8 on a 16-core host
    assert cpu_threads.thread_count(16, {"LOCAL_WORLD_SIZE": "4"}) == 2  # 4 ranks share the 8
    assert cpu_threads.thread_count(1, {}) == 1
    monkeypatch.setattr(cpu_threads, "bound_to_some_cpus", lambda: True)  # srun --cpu-bind: 8 CPUs of its own
    assert cpu_threads.thread_count(16, {"LOCAL_WORLD_SIZE": "4"}) == 8


def test_the_trainer_says_how_many_threads_it_uses(tiny_recipe, tmp_path):
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 1)
    assert "cpu: 1 torch thread(s) per process (OMP_NUM_THREADS=1)\n" in result.stdout  # the suite's setting


@pytest.mark.parametrize("env", [{"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}, {"MKL_NUM_THREADS": "2"},
                                 {"OMP_NUM_THREADS": "2"}])
def test_the_planned_count_is_the_one_torch_takes_from_mkl_or_omp_num_threads(env):
    """MKL_NUM_THREADS, when set, overrides OMP_NUM_THREADS in torch: the look before torch loads
    plans the threads torch then runs, and the line names the variable they came from."""
    got, _ = command(**env)
    name = "MKL_NUM_THREADS" if "MKL_NUM_THREADS" in env else "OMP_NUM_THREADS"
    assert cpu_threads.planned_threads(env) == got["threads"] == int(env[name])
    assert f"({name}={env[name]})" in got["line"]


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_thread_variable_set_to_no_count_is_not_the_users_count(value):
    """torch ignores OMP_NUM_THREADS=abc (or 0) and counts the cores: the command shares them among
    the machine's ranks as if it were unset, the count it planned before torch loaded and the line
    says."""
    default = torch_default_threads()
    got, _ = command(OMP_NUM_THREADS=value, LOCAL_WORLD_SIZE="2")
    shared = 1 if cpu_threads.bound_to_some_cpus() else 2
    assert got["threads"] == max(1, min(default, cpu_threads.available_cpus()) // shared)
    assert cpu_threads.planned_threads({"OMP_NUM_THREADS": value, "LOCAL_WORLD_SIZE": "2"}) == got["threads"]
    assert "CPU(s) available" in got["line"]
