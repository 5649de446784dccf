"""The suite's fork server (tests/fork_server.py): a command run through it behaves as the same
command in a fresh interpreter, in everything the tests read."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, ForkServer, run_command

PROBE = """
import json, os, sys
import huggingface_hub.constants
report = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "hf_home": huggingface_hub.constants.HF_HOME,
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


def test_commands_go_through_the_server_unless_told_or_launched(tmp_path, probe, monkeypatch):
    from conftest import cli_env
    monkeypatch.delenv("DDPM_TEST_FRESH_INTERPRETERS", raising=False)  # the caller's choice: not this test's
    env = cli_env(tmp_path)
    assert ForkServer.for_command(None, [probe, "exit", "0"], env) is not None
    assert ForkServer.for_command(None, ["-m", "diffusion_extras.sample", "--help"], env) is not None
    assert ForkServer.for_command([sys.executable, "-m", "torch.distributed.run"], [probe], env) is None
    assert ForkServer.for_command(None, ["-c", "pass"], env) is None
    assert ForkServer.for_command(None, [probe], {**env, "OMP_NUM_THREADS": "2"}) is None  # fixed at start-up
    monkeypatch.setenv("DDPM_TEST_FRESH_INTERPRETERS", "1")
    assert ForkServer.for_command(None, [probe], env) is None


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
