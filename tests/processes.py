"""Commands in processes of their own, for the tests whose question only a process answers: signals
and kills from outside, several ranks, launchers, Slurm, settings read at import, a command that
must not import torch. Each runs this interpreter (sys.executable) from the project root, through
plain subprocess."""
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

from helpers import ROOT, checked


def torchrun() -> list[str]:
    """A 2-rank launcher on one machine. --standalone: the launcher's rendezvous binds a free port
    itself (probing for a free port and passing it races with the connections other tests open)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def cli_env() -> dict:
    """The environment of a command a test runs as a process: the test process's (offline, as
    tests/conftest.py set it), with a fixed hash seed and output written as it is printed (a test
    that signals a running command watches its lines)."""
    return {**os.environ, "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def rank_environments(env: dict, ranks: int):
    """([env] for one rank, None) or, for ranks > 1, the environment of each rank of a process group
    on this machine (gloo with ACCELERATE_USE_CPU=1): `env` with the variables torch.distributed.run
    gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), and the
    group's rendezvous store, hosted by this process as torchrun's agent hosts it
    (TORCHELASTIC_USE_AGENT_STORE): keep it until the ranks have ended."""
    if ranks == 1:
        return [env], None
    import torch.distributed
    # port 0: the OS picks a free port as it binds, so no other test can take it in between
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
             "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"} for rank in range(ranks)], store


def start_command(command, env, stdout, stderr, ranks=1):
    """`command` (`python ...`) started from the project root in a session of its own, as a job
    scheduler starts a job, with `env` as its whole environment and its output to the files `stdout`
    and `stderr`, for a test that signals it while it runs. ranks > 1: that many ranks of one process
    group (rank_environments), each in a session of its own as torch.distributed.run starts them.
    Returns a Ranks."""
    envs, store = rank_environments(env, ranks)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        return Ranks([subprocess.Popen([str(part) for part in command], cwd=ROOT, env=rank_env,
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
                      for rank_env in envs], store)


class Ranks:
    """Processes started together (the ranks of a process group, or one command) with what the tests
    use of subprocess.Popen: pid (the first's), poll() and wait(timeout) giving the group's exit code
    (the first failing rank's that was not killed for another's failure), `with` (which kills what
    still runs); returncodes, each rank's. As torch.distributed.run does, once a rank has failed the
    others have PEERS_GRACE_SECONDS to end, then are killed."""
    PEERS_GRACE_SECONDS = 10

    def __init__(self, processes, store=None):
        self.processes, self.store, self.pid = processes, store, processes[0].pid
        self.failed_at = self.returncode = self.returncodes = None

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def poll(self):
        codes = [process.poll() for process in self.processes]
        if self.failed_at is None and any(codes):
            self.failed_at = time.monotonic()
        late = self.failed_at is not None and time.monotonic() - self.failed_at > self.PEERS_GRACE_SECONDS
        if None in codes and late:
            self.kill()
            codes = [process.wait() for process in self.processes]
        if None not in codes:
            failed = [code for code in codes if code != 0]
            self.returncodes, self.store = codes, None
            self.returncode = next((code for code in failed if code != -signal.SIGKILL), failed[0] if failed else 0)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        for process in self.processes:
            process.wait()


def run_command(args, *, launcher=None, env=None, timeout=300, check=True, ranks=1, merge_stderr=False):
    """`launcher + args` (default launcher: this interpreter, `sys.executable`) run from the project
    root in a process of its own, in cli_env() with `env` (None unsets); returns a CompletedProcess
    and, unless check=False, fails the test when the command exits non-zero. merge_stderr: stderr
    into stdout in the order written (`2>&1`); the result's stderr is then "".
    ranks > 1: `python ARGS` as that many ranks of one process group on this machine (start_command):
    their stdout and stderr in rank order, the group's exit code, and `returncodes`, each rank's."""
    command = (launcher or [sys.executable]) + [str(arg) for arg in args]
    assert ranks == 1 or launcher is None, "ranks start as `python ARGS`"
    merged = {name: str(value) for name, value in {**cli_env(), **(env or {})}.items() if value is not None}
    envs, store = rank_environments(merged, ranks)
    with tempfile.TemporaryDirectory(prefix="ddpm-test-command-") as outputs, contextlib.ExitStack() as files:
        streams = [[files.enter_context(open(os.path.join(outputs, f"{rank}.{name}"), "w+"))
                    for name in ("stdout", "stderr")] for rank in range(ranks)]
        with Ranks([subprocess.Popen(command, cwd=ROOT, env=rank_env, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT if merge_stderr else err)
                    for rank_env, (out, err) in zip(envs, streams)], store) as group:
            group.wait(timeout)
        texts = [(read_back(out), read_back(err)) for out, err in streams]
    result = subprocess.CompletedProcess(command, group.returncode, "".join(out for out, _ in texts),
                                         "".join(err for _, err in texts))
    result.returncodes = group.returncodes
    return checked(result, " ".join(command), check)


def read_back(fh) -> str:
    fh.seek(0)
    return fh.read()


def launch_training(recipe, output_dir, *flags, faults=(), launcher=None, env=None, timeout=300, check=True,
                    ranks=1):
    """`train_ddpm.py --config RECIPE --output_dir OUTPUT_DIR FLAGS` in processes of their own
    (run_command), or with `faults` (flags of tests/faults.py, e.g. ("--stop_after_checkpoint", 3))
    tests/faults.py, which runs the trainer with those faults. launcher: e.g. torchrun(); ranks:
    run_command's."""
    script = ["tests/faults.py", *faults, "--"] if faults else ["train_ddpm.py"]
    return run_command([*script, "--config", recipe, "--output_dir", output_dir, *flags], launcher=launcher, env=env,
                       timeout=timeout, check=check, ranks=ranks)
