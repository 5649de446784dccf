"""The suite's fork server (tests/fork_server.py): a command run through it behaves as the same
command in a fresh interpreter, in everything the tests read."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, ForkServer, cli_env, run_command

PROBE = """
import json, os, signal, sys
import huggingface_hub.constants
report = {"sigpipe": str(signal.getsignal(signal.SIGPIPE)),
          "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "hf_home": huggingface_hub.constants.HF_HOME,
          "offline": huggingface_hub.constants.HF_HUB_OFFLINE, "marker": os.environ.get("PROBE_MARKER"),
          "stdin": sys.stdin.read()}
print(json.dumps(report))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "exit":
    sys.exit(int(sys.argv[2]))
if how == "raise":
    raise ValueError("probe failure")
if how == "kill":
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sleep":
    import time
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
    forked = run_command(args, tmp_path, env=env, timeout=timeout)
    fresh = run_command(args, tmp_path, env={**(env or {}), "DDPM_TEST_FRESH_INTERPRETERS": "1"}, timeout=timeout)
    return forked, fresh


def test_commands_go_through_the_server_unless_told_or_launched(tmp_path, probe):
    env = cli_env(tmp_path)
    assert ForkServer.for_command(None, [probe, "exit", "0"], env) is not None
    assert ForkServer.for_command(None, ["-m", "diffusion_extras.sample", "--help"], env) is not None
    assert ForkServer.for_command([sys.executable, "-m", "torch.distributed.run"], [probe], env) is not None
    assert ForkServer.for_command(["accelerate", "launch"], [probe], env) is None
    assert ForkServer.for_command(None, ["-c", "pass"], env) is None
    assert ForkServer.for_command(None, [probe], {**env, "OMP_NUM_THREADS": "2"}) is None  # fixed at start-up
    assert ForkServer.for_command(None, [probe], {**env, "DDPM_TEST_FRESH_INTERPRETERS": "1"}) is None


@pytest.mark.parametrize("how,expected", [("exit", 3), ("exit", 0), ("raise", 1), ("kill", -9)])
def test_a_forked_command_is_a_fresh_interpreter_to_the_tests(tmp_path, probe, how, expected):
    args = [probe, how, expected] if how == "exit" else [probe, how]
    env = {"PROBE_MARKER": f"m-{how}", "HF_HUB_OFFLINE": "0"}
    forked, fresh = run_both(tmp_path, args, env=env)
    assert forked.returncode == fresh.returncode == expected
    assert json.loads(forked.stdout) == json.loads(fresh.stdout)
    report = json.loads(forked.stdout)
    assert report["argv"] == [str(probe), *map(str, args[1:])] and report["cwd"] == ROOT
    assert report["path0"] == str(probe.parent) and report["marker"] == f"m-{how}" and report["stdin"] == ""
    # huggingface_hub is imported by the child, so it reads the child's variables
    assert report["hf_home"] == str(tmp_path / "hf_home") and report["offline"] is False
    assert forked.stderr.startswith("to stderr")
    if how == "raise":
        assert "ValueError: probe failure" in forked.stderr and "Traceback" in forked.stderr


def test_a_module_command_runs_with_the_working_directory_first_on_the_path(tmp_path):
    forked, fresh = run_both(tmp_path, ["-m", "diffusion_extras.sample", "--help"])
    assert forked.returncode == fresh.returncode == 0
    assert forked.stdout == fresh.stdout and "usage:" in forked.stdout


def test_a_command_past_its_timeout_is_killed_and_the_server_serves_the_next(tmp_path, probe):
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([probe, "sleep"], tmp_path, timeout=3)
    after = run_command([probe, "exit", "5"], tmp_path)
    assert after.returncode == 5 and json.loads(after.stdout)["argv"][1:] == ["exit", "5"]


FINGERPRINT = """
import importlib, json, os, sys, types
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import fork_server
for name in fork_server.PRELOADED:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
from fork_server import plain
def defaults(function):
    return [function.__defaults__, function.__kwdefaults__]
values = {"sys.path": repr(sys.path[1:])}
for module_name in sorted(sys.modules):
    if not module_name.startswith(("huggingface_hub", "datasets", "diffusers", "transformers", "accelerate")):
        continue
    for key, value in list(vars(sys.modules[module_name]).items()):
        where = f"{module_name}.{key}"
        if key.startswith("__"):
            continue
        if plain(value):
            values[where] = repr(value)
        elif isinstance(value, types.FunctionType) and plain(defaults(value)):
            values[where + "()"] = repr(defaults(value))
        elif isinstance(value, type) and value.__module__ == module_name:
            for attribute, member in list(vars(value).items()):
                if isinstance(member, types.FunctionType) and plain(defaults(member)):
                    values[f"{where}.{attribute}()"] = repr(defaults(member))
                elif not attribute.startswith("__") and plain(member):
                    values[f"{where}.{attribute}"] = repr(member)
print(json.dumps(values))
"""


def test_a_forked_child_holds_the_module_values_of_a_fresh_interpreter_under_its_own_hf_variables(tmp_path):
    """Every plain value (str, number, path, container of them) held by a module of huggingface_hub,
    datasets, diffusers, transformers or accelerate, as a module attribute, class attribute or
    default argument, is the same in a forked child and in a fresh interpreter, under HF_* values
    other than the server's (fork_server.reread_environment_values). Ignored: what differs between
    two fresh interpreters too (random session ids, pids), and fsspec's instance caches, which are
    keyed by that pid and emptied by fsspec itself in a child."""
    script = tmp_path / "fingerprint.py"
    script.write_text(FINGERPRINT)
    warm = run_command([script], tmp_path / "warm", env={"HF_ENDPOINT": "http://127.0.0.1:1"}, check=True)
    assert ForkServer.for_command(None, [script], cli_env(tmp_path)) is not None  # it was forked
    env = {"HF_HOME": str(tmp_path / "home"), "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    forked = json.loads(run_command([script], tmp_path, env=env, check=True).stdout)
    fresh, again = (json.loads(run_command([script], tmp_path, env={**env, "DDPM_TEST_FRESH_INTERPRETERS": "1"},
                                           check=True).stdout) for _ in range(2))
    varies = {key for key in fresh.keys() | again.keys() if fresh.get(key) != again.get(key)}
    varies |= {key[:-len("_pid")] + "_cache" for key in varies if key.endswith("._pid")}
    differ = {key: (forked.get(key), fresh.get(key)) for key in forked.keys() | fresh.keys()
              if key not in varies and forked.get(key) != fresh.get(key)}
    assert not differ, differ
    # the test sees a stale value: the server's differ, and the values compared are the child's
    assert json.loads(warm.stdout)["huggingface_hub.constants.ENDPOINT"] == repr("http://127.0.0.1:1")
    assert forked["huggingface_hub.constants.ENDPOINT"] == repr("http://127.0.0.1:9")
    assert forked["datasets.config.HF_DATASETS_CACHE"] == repr(tmp_path / "datasets")
    assert forked["diffusers.utils.constants.HF_MODULES_CACHE"] == repr(str(tmp_path / "modules"))


RANK_PROBE = """
import json, os, sys
import huggingface_hub.constants
report = json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
                     "path0": sys.path[0], "endpoint": huggingface_hub.constants.ENDPOINT,
                     "pgid_is_pid": os.getpgid(0) == os.getpid()})
# one write per line: torchrun runs its workers with `python -u`, where print() writes the text
# and its newline in two system calls, so two ranks printing at once can put both reports on one line
os.write(1, (report + "\\n").encode())
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    sys.exit(7)
"""


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_a_launched_command_and_its_ranks_behave_as_fresh_interpreters(tmp_path, how):
    """torch.distributed.run through the server: each rank is a fork in its own session with its
    own variables, argv and stdout, and a failing rank fails the launch as it does with fresh ones."""
    from test_resume import torchrun
    script = tmp_path / "rank_probe.py"
    script.write_text(RANK_PROBE)
    env = {"HF_ENDPOINT": "http://127.0.0.1:7"}
    assert ForkServer.for_command(torchrun(), [script, how], cli_env(tmp_path)) is not None
    forked = run_command([script, how], tmp_path, launcher=torchrun(), env=env)
    fresh = run_command([script, how], tmp_path, launcher=torchrun(), env={**env, "DDPM_TEST_FRESH_INTERPRETERS": "1"})
    assert forked.returncode == fresh.returncode == (0 if how == "ok" else 1), forked.stderr[-3000:]
    reports = [sorted((json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")),
                      key=lambda report: report["rank"]) for run in (forked, fresh)]
    assert reports[0] == reports[1] and [report["rank"] for report in reports[0]] == ["0", "1"]
    assert all(report["endpoint"] == "http://127.0.0.1:7" and report["pgid_is_pid"] for report in reports[0])
    if how == "fail":
        assert "exitcode  : 7" in forked.stderr and "exitcode  : 7" in fresh.stderr
