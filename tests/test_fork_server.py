"""The suite's fork server (tests/fork_server.py): a command it runs behaves as the same command in
a fresh interpreter, in everything a test can read, and a command it cannot run so runs fresh."""
import json
import re
import sys

import pytest
from conftest import ROOT, ForkServer, cli_env, run_command

PROBE = """
import atexit, gc, json, os, random, signal, sys, threading, time
import numpy, torch
import datasets.fingerprint, huggingface_hub.constants
report = {"sigpipe": str(signal.getsignal(signal.SIGPIPE)), "sigint": str(signal.getsignal(signal.SIGINT)),
          "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "hf_home": huggingface_hub.constants.HF_HOME,
          "offline": huggingface_hub.constants.HF_HUB_OFFLINE, "marker": os.environ.get("PROBE_MARKER"),
          "stdin": sys.stdin.read(), "main": __name__, "unbuffered": sys.stdout.write_through, "gc": gc.isenabled(),
          "random": [random.random(), float(numpy.random.random()), torch.initial_seed(),
                     datasets.fingerprint.generate_random_fingerprint()]}
print(json.dumps(report))
print("to stderr", file=sys.stderr)
atexit.register(print, "atexit ran", file=sys.stderr)
def late():
    time.sleep(0.3)
    print("thread joined", file=sys.stderr)
threading.Thread(target=late).start()
how = sys.argv[1]
if how == "exit":
    sys.exit(int(sys.argv[2]))
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("probe failure")
if how == "interrupt":
    raise KeyboardInterrupt
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sleep":
    time.sleep(60)
"""


@pytest.fixture(autouse=True)
def forking_allowed(monkeypatch):
    """These tests are of the server itself: a caller's DDPM_TEST_FRESH_INTERPRETERS=1 (every other
    command fresh) does not apply; the fresh side of each comparison sets it on its own command."""
    monkeypatch.delenv("DDPM_TEST_FRESH_INTERPRETERS", raising=False)


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def run_both(tmp_path, args, env=None, timeout=60):
    """(through the fork server, in a fresh interpreter) for the same command."""
    assert ForkServer.for_command(None, args, {**cli_env(), **(env or {})}) is not None
    forked = run_command(args, tmp_path, env=env, timeout=timeout)
    fresh = run_command(args, tmp_path, env={**(env or {}), "DDPM_TEST_FRESH_INTERPRETERS": "1"}, timeout=timeout)
    return forked, fresh


def test_the_preloaded_imports_print_nothing_start_no_thread_and_read_the_hf_variables(tmp_path):
    """A warning printed by a preloaded import would be missing from every child's stderr, and a
    thread would not survive the fork: either one would send every command to a fresh interpreter."""
    server = ForkServer.for_command(None, ["x.py"], cli_env())
    assert server is not None
    assert server.ready["printed"] == "" and server.ready["threads"] == 1
    assert {"HF_HOME", "HF_HUB_OFFLINE", "HF_ENDPOINT"} <= set(server.ready["read"])  # so they must match


def test_commands_go_through_the_server_unless_it_cannot_start_them_as_python_would(tmp_path, probe):
    env = cli_env()
    assert ForkServer.for_command(None, [probe, "exit", "0"], env) is not None
    assert ForkServer.for_command(None, ["-m", "diffusion_extras.sample", "--help"], env) is not None
    assert ForkServer.for_command([sys.executable, "-m", "torch.distributed.run"], [probe], env) is not None
    assert ForkServer.for_command(["accelerate", "launch"], [probe], env) is None
    assert ForkServer.for_command(None, ["-c", "pass"], env) is None
    assert ForkServer.for_command(None, [probe], {**env, "OMP_NUM_THREADS": "2"}) is None  # read at start-up
    buffered = {name: value for name, value in env.items() if name != "PYTHONUNBUFFERED"}
    assert ForkServer.for_command(None, [probe], buffered) is None  # the interpreter sets up sys.stdout with it
    assert ForkServer.for_command(None, [probe], {**env, "HF_HOME": str(tmp_path / "other")}) is None  # at import
    assert ForkServer.for_command(None, [probe], {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}) is None
    assert ForkServer.for_command(None, [probe], {**env, "DDPM_TEST_FRESH_INTERPRETERS": "1"}) is None


def without_runpy_frames(stderr: str) -> str:
    """A traceback without the frames of runpy and of tests/fork_server.py (a fork runs the script
    from there; `python -m` shows runpy's frames too)."""
    return re.sub(r'  File "(<frozen runpy>|[^"]*fork_server\.py)", line \d+, in \S+\n(    .*\n)*', "", stderr)


@pytest.mark.parametrize("how,expected", [("end", 0), ("exit", 3), ("exit", 0), ("message", 1), ("raise", 1),
                                          ("interrupt", -2), ("kill", -9)])
def test_a_forked_command_is_a_fresh_interpreter_to_the_tests(tmp_path, probe, how, expected):
    args = [probe, how, expected] if how == "exit" else [probe, how]
    env = {"PROBE_MARKER": f"m-{how}"}
    forked, fresh = run_both(tmp_path, args, env=env)
    assert forked.returncode == fresh.returncode == expected
    reports = [json.loads(run.stdout) for run in (forked, fresh)]
    assert [{**report, "random": None} for report in reports] == [{**reports[1], "random": None}] * 2
    report = reports[0]
    assert report["argv"] == [str(probe), *map(str, args[1:])] and report["cwd"] == ROOT
    assert report["main"] == "__main__"
    assert report["path0"] == str(probe.parent) and report["marker"] == f"m-{how}" and report["stdin"] == ""
    assert report["hf_home"] == cli_env()["HF_HOME"] and report["offline"] is True and report["unbuffered"]
    # stderr as a fresh interpreter writes it: warnings, the exit's message or traceback, the
    # non-daemon thread joined and atexit run (but after a SIGKILL)
    assert without_runpy_frames(forked.stderr) == fresh.stderr
    assert forked.stderr.startswith("to stderr") and (how == "kill") != ("atexit ran" in forked.stderr)
    if how == "raise":
        assert "Traceback" in forked.stderr and "ValueError: probe failure" in forked.stderr


def test_each_fork_draws_its_own_random_numbers(tmp_path, probe):
    """random, numpy's global generator, torch's default one and datasets' fingerprint generator
    are seeded from the OS in each fork, as a fresh interpreter seeds them (shared with the server,
    every fork would draw the same)."""
    draws = [json.loads(run_command([probe, "exit", "0"], tmp_path).stdout)["random"] for _ in range(2)]
    assert all(first != second for first, second in zip(*draws, strict=True))


def test_a_module_command_and_a_one_line_error_are_those_of_a_fresh_interpreter(tmp_path):
    forked, fresh = run_both(tmp_path, ["-m", "diffusion_extras.sample", "--help"])
    assert forked.returncode == fresh.returncode == 0
    assert forked.stdout == fresh.stdout and "usage:" in forked.stdout and forked.stderr == fresh.stderr
    forked, fresh = run_both(tmp_path, ["train_ddpm.py", "--config", tmp_path / "missing.yaml"])
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and len(forked.stderr.splitlines()) == 1 and "missing.yaml" in forked.stderr
    for args, code in (([tmp_path / "missing.py"], 2), (["-m", "diffusion_extras.missing"], 1)):  # python's refusal
        forked, fresh = run_both(tmp_path, args)
        assert forked.returncode == fresh.returncode == code and forked.stderr == fresh.stderr
        assert forked.stderr.startswith(f"{sys.executable}: ") and len(forked.stderr.splitlines()) == 1


def test_a_training_command_prints_to_stdout_what_a_fresh_interpreter_prints(tmp_path):
    """What lets =contract fork the tests that read only a command's stdout: a training run's
    lines, forked and fresh, are the same but for its output folder and the seconds it measured."""
    from conftest import write_tiny_recipe
    recipe = write_tiny_recipe(tmp_path, save_images_steps=2)
    assert ForkServer.for_command(None, ["train_ddpm.py"], cli_env()) is not None  # the first one forks
    runs = [run_command(["train_ddpm.py", "--config", recipe, "--output_dir", tmp_path / name, "--max_train_steps", 2],
                        tmp_path, env=env, check=True)
            for name, env in (("forked", {}), ("fresh", {"DDPM_TEST_FRESH_INTERPRETERS": "1"}))]
    lines = [re.sub(r"\d+\.\d s\b", "<seconds>", run.stdout.replace(str(tmp_path / name), "<out>"))
             for run, name in zip(runs, ("forked", "fresh"))]
    assert lines[0] == lines[1] and "model: " in lines[0] and "final sample grid" in lines[0], lines


INTERLEAVED = """
import sys
for line in range(3):
    print(f"out {line}")
    print(f"err {line}", file=sys.stderr)
sys.stderr.write("err without newline, then ")
print("out at the end")
"""


def test_merged_streams_keep_the_order_they_were_written_in_forked_or_fresh(tmp_path):
    """run_command(merge_stderr=True), as subprocess.STDOUT (`2>&1`): one text, lines in the order
    written, the same forked and fresh."""
    script = tmp_path / "interleaved.py"
    script.write_text(INTERLEAVED)
    forked, fresh = (run_command([script], tmp_path, env=env, merge_stderr=True)
                     for env in ({}, {"DDPM_TEST_FRESH_INTERPRETERS": "1"}))
    expected = "out 0\nerr 0\nout 1\nerr 1\nout 2\nerr 2\nerr without newline, then out at the end\n"
    assert forked.stdout == fresh.stdout == expected and forked.stderr == fresh.stderr == ""


def test_a_command_past_its_timeout_is_killed_and_the_server_serves_the_next(tmp_path, probe):
    import subprocess
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([probe, "sleep"], tmp_path, timeout=3)
    after = run_command([probe, "exit", "5"], tmp_path)
    assert after.returncode == 5 and json.loads(after.stdout)["argv"][1:] == ["exit", "5"]


FINGERPRINT = """
import importlib, json, os, sys, types
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import fork_server
for name in fork_server.PRELOADED:
    importlib.import_module(name)
def plain(value, depth=0):
    if type(value) in (str, int, float, bool, type(None)) or isinstance(value, os.PathLike):
        return True
    if depth < 2 and type(value) in (tuple, list, set, frozenset):
        return all(plain(item, depth + 1) for item in value)
    if depth < 2 and type(value) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False
def defaults(function):
    return [function.__defaults__, function.__kwdefaults__]
values = {"sys.path": repr(sys.path[1:]),
          "environ": sorted(item for item in os.environ.items() if item[0] != "DDPM_TEST_FRESH_INTERPRETERS")}
for module_name in sorted(sys.modules):
    if not module_name.startswith(("huggingface_hub", "datasets", "diffusers", "transformers", "accelerate",
                                   "torch", "diffusion_extras")):
        continue
    for key, value in list(vars(sys.modules[module_name]).items()):
        where = f"{module_name}.{key}"
        if key.startswith("__"):
            continue
        if plain(value) and type(value) in (list, tuple, set, frozenset):
            # in any order: a list made from a set of objects (ordered by their addresses, e.g. torch
            # dynamo's banned_attrs) comes in a different order in each interpreter
            values[where] = repr(sorted(map(repr, value)))
        elif plain(value):
            values[where] = repr(value)
        elif type(value) is types.FunctionType and plain(defaults(value)):
            values[where + "()"] = repr(defaults(value))
print(json.dumps(values))
"""


def test_a_forked_child_holds_the_module_values_and_environment_of_a_fresh_interpreter(tmp_path):
    """Every plain value (str, number, path, container of them) held by a module of torch,
    huggingface_hub, datasets, diffusers, transformers, accelerate or this package, as a module
    attribute or default argument, and the whole environment, are the same in a fork and in a fresh
    interpreter.
    Ignored: what differs between two fresh interpreters too (session ids, pids, fsspec's caches)."""
    script = tmp_path / "fingerprint.py"
    script.write_text(FINGERPRINT)
    forked, fresh = (json.loads(run.stdout) for run in run_both(tmp_path, [script], timeout=120))
    again = json.loads(run_command([script], tmp_path, env={"DDPM_TEST_FRESH_INTERPRETERS": "1"}).stdout)
    varies = {key for key in fresh.keys() | again.keys() if fresh.get(key) != again.get(key)}
    differ = {key: (forked.get(key), fresh.get(key)) for key in forked.keys() | fresh.keys()
              if key not in varies and forked.get(key) != fresh.get(key)}
    assert not differ, differ
    assert len(forked) > 1000  # it did read the modules


RANK_PROBE = """
import json, os, sys
report = json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
                     "path0": sys.path[0], "fresh": "torch" not in sys.modules, "marker": os.environ["PROBE_MARKER"],
                     "pgid_is_pid": os.getpgid(0) == os.getpid()})
os.write(1, (report + "\\n").encode())  # one write: two ranks print at once
if sys.argv[1] == "fail":
    # Rank 1 fails only once rank 0 has reported: the launcher stops the other ranks as soon as one
    # fails, and rank 0 could otherwise be stopped before its report (seen in CI).
    import pathlib, time
    reported = pathlib.Path(__file__).parent / f"rank0-reported-by-{os.getppid()}"  # ranks share a launcher
    if os.environ["RANK"] == "0":
        reported.write_text("")
    else:
        deadline = time.monotonic() + 60
        while not reported.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(7)
"""


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_a_forked_launcher_starts_fresh_ranks(tmp_path, how):
    """torch.distributed.run may be forked from the server; the ranks it starts are fresh
    interpreters (nothing imported yet), each in its own session, and a failing rank fails the
    launch, as with a fresh launcher."""
    from test_resume import torchrun
    script = tmp_path / "rank_probe.py"
    script.write_text(RANK_PROBE)
    forked, fresh = run_both(tmp_path, [*torchrun()[1:], script, how], env={"PROBE_MARKER": "m"}, timeout=120)
    assert forked.returncode == fresh.returncode == (0 if how == "ok" else 1), forked.stderr[-3000:]
    reports = [sorted((json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")),
                      key=lambda report: report["rank"]) for run in (forked, fresh)]
    assert reports[0] == reports[1] and [report["rank"] for report in reports[0]] == ["0", "1"]
    assert all(report["fresh"] and report["pgid_is_pid"] and report["marker"] == "m" for report in reports[0])
    if how == "fail":
        assert "exitcode  : 7" in forked.stderr and "exitcode  : 7" in fresh.stderr


GROUP_PROBE = """
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1])
dist.all_reduce(total)
os.write(1, (json.dumps({"rank": rank, "world": dist.get_world_size(), "sum": int(total),
                         "local": os.environ["LOCAL_RANK"], "marker": os.environ["PROBE_MARKER"]}) + "\\n").encode())
# The group is ended before any rank exits, as torch asks. Left to the interpreter's exit, gloo's
# teardown sometimes aborts while the peer still runs (SIGABRT, "terminate called without an active
# exception"): seen once in a CI-mode run, then in 2 of 30 stand-alone runs of "fail"; 0 of 130 with
# the destroy. (The trainer's exit, commands.exit_with, ended 80 of 80 two-rank runs cleanly.)
dist.destroy_process_group()
if sys.argv[1] == "fail":
    if rank == 1:
        sys.exit(7)
    time.sleep(600)  # rank 0 waits on: the harness ends it once rank 1 has failed
if sys.argv[1] == "late":  # both stop; rank 0 ends half a second after rank 1 (the line left to it)
    time.sleep(0.5 * (rank == 0))
    print("stopped", file=sys.stderr) if rank == 0 else None
    sys.exit(4)
"""


@pytest.mark.parametrize("how, returncodes", [("ok", [0, 0]), ("fail", [-9, 7]), ("late", [4, 4])])
def test_ranks_form_one_process_group_and_a_failed_rank_ends_the_run(tmp_path, how, returncodes):
    """run_command(ranks=2): two processes of one gloo group (each all-reduces its rank), set up as
    torch.distributed.run sets up its workers; if one fails, the other may end on its own within
    fork_server.PEERS_GRACE_SECONDS ("late"), else it is killed ("fail"), and the run returns the
    failing rank's code, forked and fresh alike."""
    script = tmp_path / "group_probe.py"
    script.write_text(GROUP_PROBE)
    assert ForkServer.for_command(None, [script], {**cli_env(), "RANK": "0", "WORLD_SIZE": "2"}) is not None
    runs = [run_command([script, how], tmp_path, env={"PROBE_MARKER": "m", **fresh}, timeout=120, ranks=2)
            for fresh in ({}, {"DDPM_TEST_FRESH_INTERPRETERS": "1"})]
    for run in runs:
        assert run.returncodes == returncodes and run.returncode == max(returncodes), run.stderr[-3000:]
        assert run.stderr.count("stopped") == (how == "late"), run.stderr[-3000:]
        reports = sorted((json.loads(line) for line in run.stdout.splitlines()), key=lambda report: report["rank"])
        assert reports == [{"rank": rank, "world": 2, "sum": 3, "local": str(rank), "marker": "m"} for rank in (0, 1)]


def test_ranks_started_for_signalling_share_their_output_files_forked_or_fresh(tmp_path):
    """conftest.start_command(ranks=2), as test_preemption starts ranks it signals: one process group,
    each rank's lines in the two files, each rank's exit code, forked and fresh alike."""
    from conftest import start_command
    script = tmp_path / "group_probe.py"
    script.write_text(GROUP_PROBE)
    for fresh in ({}, {"DDPM_TEST_FRESH_INTERPRETERS": "1"}):
        out, err = tmp_path / "out", tmp_path / "err"
        env = {**cli_env(), "PROBE_MARKER": "m", **fresh}
        with start_command([sys.executable, script, "late"], env, out, err, ranks=2) as process:
            assert process.wait(120) == 4 and process.returncodes == [4, 4], err.read_text()[-3000:]
        reports = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda report: report["rank"])
        assert [report["rank"] for report in reports] == [0, 1] and err.read_text() == "stopped\n"


SESSION_PROBE = """
import json, os, signal, sys, time
preloaded = "torch" in sys.modules
worker = os.fork()
if worker == 0:  # a loader worker's stand-in: the default SIGTERM ends it
    time.sleep(600)
    os._exit(0)
def stop(number, frame):
    print("stopped by", signal.Signals(number).name, file=sys.stderr)
    sys.exit(4)
signal.signal(signal.SIGTERM, stop)
print(json.dumps({"preloaded": preloaded, "session_leader": os.getsid(0) == os.getpid(),
                  "group_leader": os.getpgid(0) == os.getpid(), "sigpipe": str(signal.getsignal(signal.SIGPIPE)),
                  "worker": worker}), flush=True)
time.sleep(600)
"""


def test_a_command_started_for_signalling_runs_in_its_own_session_forked_or_fresh(tmp_path, probe):
    """conftest.start_command (test_preemption signals the commands it starts): a session of its own
    whose process group, a worker included, takes the signal, with the same exit and output forked
    and fresh; leaving its `with` ends a command still running and frees the server for the next."""
    import os
    import signal
    import time

    from conftest import start_command
    from test_preemption import wait_while_running
    script = tmp_path / "session_probe.py"
    script.write_text(SESSION_PROBE)
    runs = []
    for fresh in ({}, {"DDPM_TEST_FRESH_INTERPRETERS": "1"}):
        out, err = tmp_path / f"out{len(runs)}", tmp_path / f"err{len(runs)}"
        with start_command([sys.executable, script], {**cli_env(), **fresh}, out, err) as process:
            wait_while_running(process, lambda out=out: out.read_text().endswith("\n"), err.read_text, seconds=60)
            os.killpg(process.pid, signal.SIGTERM)
            assert process.wait(30) == 4
        report = json.loads(out.read_text())
        with pytest.raises(ProcessLookupError):  # the worker took the group's signal too (and was reaped)
            for _ in range(600):
                os.kill(report["worker"], 0)
                time.sleep(0.05)
        runs.append((report.pop("preloaded"), {**report, "worker": None}, err.read_text()))
    assert [preloaded for preloaded, _, _ in runs] == [True, False]  # forked, then fresh
    assert runs[0][1:] == runs[1][1:] and runs[0][2] == "stopped by SIGTERM\n"
    assert runs[0][1]["session_leader"] and runs[0][1]["group_leader"]
    with start_command([sys.executable, script], cli_env(), tmp_path / "out", tmp_path / "err") as process:
        pass  # still running: killed here
    assert process.returncode == -signal.SIGKILL
    assert run_command([probe, "exit", "5"], tmp_path, timeout=60).returncode == 5  # the server serves the next


def test_contract_mode_runs_the_commands_of_contract_tests_fresh(monkeypatch, probe):
    """DDPM_TEST_FRESH_INTERPRETERS=contract: fresh interpreters for the commands of the
    tests marked `contract`, forks for the others."""
    from conftest import RUNNING
    env = {**cli_env(), "DDPM_TEST_FRESH_INTERPRETERS": "contract"}
    monkeypatch.setitem(RUNNING, "contract", True)
    assert ForkServer.for_command(None, [probe], env) is None
    monkeypatch.setitem(RUNNING, "contract", False)
    assert ForkServer.for_command(None, [probe], env) is not None


def test_under_contract_a_command_whose_result_is_dropped_forks(monkeypatch, tmp_path):
    """=contract, in a contract test: a command whose result the test drops (a runner call alone as
    a statement; it leaves files) forks, one whose result it keeps runs fresh."""
    from conftest import RUNNING
    monkeypatch.setenv("DDPM_TEST_FRESH_INTERPRETERS", "contract")
    assert RUNNING["contract"]
    script = tmp_path / "preloaded.py"
    script.write_text('import json, sys\nopen(sys.argv[1], "w").write(json.dumps("torch" in sys.modules))\n')
    run_command([script, tmp_path / "dropped"], tmp_path,  # on two lines: any line of the statement counts
                check=True)
    kept = run_command([script, tmp_path / "kept"], tmp_path, check=True)
    assert kept.returncode == 0
    assert json.loads((tmp_path / "dropped").read_text()) is True  # forked: the server had imported torch
    assert json.loads((tmp_path / "kept").read_text()) is False


def test_a_test_that_reads_a_commands_exit_code_is_known_as_a_contract_test_while_it_runs(tmp_path, probe):
    from conftest import RUNNING
    assert RUNNING["contract"]
    assert run_command([probe, "exit", "0"], tmp_path).returncode == 0


def read_through_a_helper(result) -> int:
    return result.returncode


def test_reading_a_commands_output_is_found_in_the_test_its_helpers_and_its_fixtures():
    """A test that reads the exit code only through a helper of the test files (test_preemption's
    assert_preempted_at), or whose fixture reads it, is a contract test, and so is one that reads
    stderr, alone or merged into stdout; conftest's runners, which read the exit code for every test
    (check=True), do not make one, nor does reading stdout alone."""
    import test_preemption
    from conftest import reads_what_a_command_printed, run_training

    def through_the_helper(tmp_path):
        return read_through_a_helper(run_training(tmp_path, "recipe", tmp_path / "run", check=False)) == 4

    def files_only(tmp_path):
        run_training(tmp_path, "recipe", tmp_path / "run")
        return (tmp_path / "run" / "unet").is_dir()

    def stdout_only(tmp_path):
        return "done:" in run_training(tmp_path, "recipe", tmp_path / "run").stdout

    def merged(tmp_path):  # stderr is in the stdout it reads
        return "done:" in run_command(["train_ddpm.py"], tmp_path, merge_stderr=True, check=True).stdout

    assert reads_what_a_command_printed(through_the_helper)
    assert not reads_what_a_command_printed(files_only)
    assert not reads_what_a_command_printed(stdout_only)  # a fork prints there what a fresh one does
    assert reads_what_a_command_printed(merged)
    assert reads_what_a_command_printed(test_preemption.test_sigterm_saves_at_the_step_and_resumes_bit_identical)
    assert not reads_what_a_command_printed(test_preemption.straight.__wrapped__)


def test_a_command_started_through_a_helper_or_a_partial_runner_makes_a_cli_test():
    """A test that starts its commands through a helper of the test files (test_bench_quality's
    run_quality), or a fixture that hands a runner on (test_resume's two_rank_runs:
    functools.partial(run_training, ...)), is a command-line test; one that names no runner is not."""
    import test_bench_quality
    import test_resume
    from conftest import names_a_runner

    assert names_a_runner(test_bench_quality.test_time_budget_calibrates_then_trains_the_steps_that_fit)
    assert names_a_runner(test_resume.two_rank_runs.__wrapped__)
    assert not names_a_runner(test_resume.test_assert_same_tree_sees_an_optimizer_moment_and_a_missing_item)
    assert not names_a_runner(read_through_a_helper)


@pytest.fixture
def contract_flag_while_a_quiet_fixture_is_set_up():
    """Reads nothing a command printed and no exit code, like a reference run that only leaves files: its
    commands fork under =contract."""
    from conftest import RUNNING
    return RUNNING["contract"]


@pytest.fixture
def contract_flag_while_a_reading_fixture_is_set_up():
    from conftest import RUNNING
    return RUNNING["contract"]  # as if it read a command's result.stderr


def test_a_contract_tests_own_commands_and_its_reading_fixtures_run_fresh_under_contract(
        contract_flag_while_a_quiet_fixture_is_set_up, contract_flag_while_a_reading_fixture_is_set_up, probe,
        tmp_path):
    from conftest import RUNNING
    assert RUNNING["contract"]  # this test reads a command's returncode
    assert not contract_flag_while_a_quiet_fixture_is_set_up
    assert contract_flag_while_a_reading_fixture_is_set_up
    assert run_command([probe, "exit", "0"], tmp_path).returncode == 0


def test_a_fixture_asked_for_while_a_contract_test_runs_gives_the_test_its_flag_back(request, probe, tmp_path):
    from conftest import RUNNING
    assert RUNNING["contract"]
    assert not request.getfixturevalue("contract_flag_while_a_quiet_fixture_is_set_up")
    assert RUNNING["contract"]
    assert run_command([probe, "exit", "0"], tmp_path).returncode == 0


def test_whether_a_command_forks_does_not_depend_on_the_command_that_started_the_server(monkeypatch, probe):
    """The server imports in the suite's environment (cli_env) even when the first command to ask
    is an online one: that command still runs fresh, and an ordinary one forks. The server that
    first command starts is this process's running one under another name (a second would cost a
    whole preload); what is asserted is the environment it is started in."""
    running = ForkServer.for_command(None, [probe], cli_env())
    started_in = []

    def start(server, env):  # ForkServer.__init__, with the running server's process and replies
        started_in.append(env)
        server.start_up, server.process, server.ready, server.outputs, server.lock = (
            running.start_up, running.process, running.ready, running.outputs, running.lock)
    monkeypatch.setattr(ForkServer, "__init__", start)
    monkeypatch.setattr(ForkServer, "_instance", None)
    monkeypatch.setattr(ForkServer, "_started_for", None)
    assert ForkServer.for_command(None, [probe], {**cli_env(), "HF_HUB_OFFLINE": "0"}) is None
    assert [env["HF_HUB_OFFLINE"] for env in started_in] == ["1"] and started_in == [cli_env()]
    assert ForkServer.for_command(None, [probe], cli_env()) is ForkServer._instance is not None
