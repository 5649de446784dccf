"""Shared fixtures: a tiny UNet recipe and model, and runners for the real command line."""
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import fork_server
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKED_TRAIN = "tests/hooked_train.py"  # train_ddpm.py with failures injected by DDPM_TEST_* variables

# 8 px grayscale, two levels, ~20k parameters: a CPU step takes milliseconds. No sample grid, debug
# images or loss plot (save_images_steps 0), which were ~40% of a 3-step command's CPU time: the
# tests of those ask for them.
TINY_RECIPE = {
    "resolution": 8, "train_batch_size": 8, "eval_batch_size": 4, "ddpm_num_inference_steps": 2,
    "diagnostics_steps": 1, "save_images_steps": 0, "save_model_steps": 1000, "checkpointing_steps": 1000,
    "logger": "none", "max_train_samples": 64, "learning_rate": 1e-3, "lr_warmup_steps": 2,
    "validation_split": 0.0, "grad_diagnostics_steps": 0,  # the digits default's held-out and gradient probes: off
    "model": {"in_channels": 1, "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
              "down_block_types": ["DownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "UpBlock2D"],
              "norm_num_groups": 4, "dropout": 0.0},
}


def write_tiny_recipe(folder, **overrides) -> str:
    """TINY_RECIPE with `overrides` as a YAML file in `folder` (named by its content); returns its path."""
    values = {**TINY_RECIPE, **overrides}
    path = os.path.join(folder, f"tiny-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh)
    return path


@pytest.fixture
def tiny_recipe(tmp_path):
    """tiny_recipe(**overrides): write_tiny_recipe in this test's folder."""
    return lambda **overrides: write_tiny_recipe(tmp_path, **overrides)


def save_random_images(folder, count: int, height: int, width: int, seed: int = 0) -> str:
    """`count` random RGB PNGs 0.png, 1.png, ... in `folder` (created); returns the folder."""
    import numpy as np
    from PIL import Image
    os.makedirs(folder, exist_ok=True)
    for index, image in enumerate(np.random.default_rng(seed).integers(0, 256, (count, height, width, 3),
                                                                        dtype=np.uint8)):
        Image.fromarray(image).save(os.path.join(folder, f"{index}.png"))
    return str(folder)


# Variables of the caller's shell that change what the libraries do (offline mode, endpoint, cache
# folders, the tracker's mode): no test may depend on them.
CALLER_VARIABLES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "WANDB_")
READ_AT_IMPORT = ("huggingface_hub", "datasets", "diffusers", "transformers", "accelerate", "wandb")


def pytest_configure(config):
    """Every test runs as in a clean shell, whatever the caller exported (HF_HUB_OFFLINE=1, a custom
    HF_HOME or HF_ENDPOINT, WANDB_MODE, ...): those variables are removed before any library reads
    them (huggingface_hub and datasets read them once, at import), and HF_HOME is a folder of this
    session. A test that needs offline mode or an endpoint sets it itself."""
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one); run them with `pytest -m cuda`")
    config.addinivalue_line("markers", "cli: starts a command (set at collection: conftest.starts_a_command)")
    config.addinivalue_line("markers", "contract: a cli test that reads a command's exit code or stderr, "
                                       "itself, through a helper or in a fixture of its module "
                                       "(DDPM_TEST_FRESH_INTERPRETERS=contract runs those commands unforked)")
    imported = sorted(name for name in sys.modules if name.split(".")[0] in READ_AT_IMPORT)
    if imported:
        raise pytest.UsageError(f"{imported[0]} was imported before the tests cleared the caller's HF_*/WANDB_* "
                                "variables (by a pytest plugin?); run pytest with -p no:<that plugin>")
    for name in list(os.environ):
        if name.startswith(CALLER_VARIABLES):
            del os.environ[name]
    # torch on one intra-op thread in every test process, as in the commands (cli_env): pytest -n 3
    # on 2 cores runs three tests at once, and torch's default of a thread per core would have them
    # wait on each other (the in-process tests took twice the CPU time with it). Also the
    # summation order of the commands, which tests that recompute a command's numbers rely on.
    os.environ["OMP_NUM_THREADS"] = "1"
    config.hf_home = os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="ddpm-tests-hf-home-")


def pytest_unconfigure(config):
    if getattr(config, "hf_home", None):
        shutil.rmtree(config.hf_home, ignore_errors=True)


def cli_env() -> dict:
    """The environment of a command a test runs: the test's, without what selects an accelerate
    config; offline, wandb offline, and the session's HF_HOME, as in-process code has (its datasets
    and decode caches are keyed by the data files' paths, which are the test's own); a fixed hash
    seed, one thread, and output written as it is printed (PYTHONUNBUFFERED, whatever the caller's
    shell says: a test that signals a running command watches its lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", HF_HOME=os.environ["HF_HOME"], PYTHONHASHSEED="0",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


RUNNING = {"contract": False}  # whether the code running now reads its commands' exit codes or stderr (hooks below)


def runs_fresh(env: dict) -> bool:
    """Whether a command in `env` starts a fresh interpreter instead of a fork of the server:
    DDPM_TEST_FRESH_INTERPRETERS=1 for every command, =contract for the commands run by code that
    reads a command's exit code or stderr (reads_what_a_command_printed): a test marked `contract`,
    or a fixture of its that reads them. A command that only leaves files or stdout forks under
    =contract too: one run by a fixture that reads neither (a reference run, say), or one whose
    result the code running it drops (result_dropped)."""
    mode = env.get("DDPM_TEST_FRESH_INTERPRETERS")
    return mode == "1" or (mode == "contract" and RUNNING["contract"] and not result_dropped())


RUNNERS = ("run_command", "run_training", "run_cli", "train", "hooked_train")  # this file's, and its fixtures'


@functools.cache
def dropped_runner_lines(filename: str) -> frozenset:
    """The lines of a test file's statements that are a runner call alone, `train(recipe, out, ...)`:
    the command's result is dropped; it leaves files (its exit code is checked by the runner)."""
    import ast
    with open(filename) as fh:
        tree = ast.parse(fh.read())
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            function = node.value.func
            if getattr(function, "id", getattr(function, "attr", None)) in RUNNERS:
                lines.update(range(node.lineno, node.end_lineno + 1))
    return frozenset(lines)


def result_dropped() -> bool:
    """Whether the test file's code that is running a command now drops its result: its innermost
    frame of a tests/test_*.py file is at one of dropped_runner_lines."""
    frame = sys._getframe(1)
    while frame is not None and not os.path.basename(frame.f_code.co_filename).startswith("test_"):
        frame = frame.f_back
    return frame is not None and frame.f_lineno in dropped_runner_lines(frame.f_code.co_filename)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    RUNNING["contract"] = item.get_closest_marker("contract") is not None
    yield
    RUNNING["contract"] = False


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """(A fixture's own fixtures are set up before this hook, each by its own call of it; one asked
    for while a test runs, request.getfixturevalue, gives the test its flag back after.)"""
    during = RUNNING["contract"]
    RUNNING["contract"] = reads_what_a_command_printed(fixturedef.func)
    yield
    RUNNING["contract"] = during


class ForkServer:
    """The client of tests/fork_server.py (read its docstring): runs `python SCRIPT ARGS` or
    `python -m MODULE ARGS` as a fork of an interpreter with the heavy libraries imported, one
    command at a time; started on first use, one per pytest process."""
    _instance = None
    _started_for = None

    def __init__(self, env: dict):
        import threading
        self.start_up = {name: env.get(name) for name in fork_server.START_UP_VARIABLES}
        self.lock = threading.Lock()
        self.outputs = tempfile.mkdtemp(prefix="fork_server_")
        self.process = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fork_server.py")], cwd=ROOT,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        self.ready = self._reply(180)
        if self.ready.get("ready") is not True:
            raise RuntimeError("the fork server did not start")

    def forks(self, env: dict) -> bool:
        """Whether a command in `env` starts as it would in a fresh interpreter: the preloaded imports
        printed nothing and started no thread, and every variable they or the interpreter read has
        the server's value (or the value the imports set themselves, which a test process that made
        those imports passes on)."""
        if self.ready["printed"] or self.ready["threads"] != 1:
            return False
        if any(env.get(name) != value for name, value in self.start_up.items()):
            return False
        return all(env.get(name) in (value, self.ready["set"].get(name, value))
                   for name, value in self.ready["read"].items())

    @classmethod
    def for_command(cls, launcher, args, env):
        """The server if it can run this command as a fresh interpreter would, else None. A launcher
        such as torch.distributed.run may be forked; the processes it starts are fresh interpreters.
        The server imports in cli_env(), whichever command asks first, so whether a command forks
        depends on the command alone, not on the order the tests run in."""
        if launcher is not None:
            if [str(part) for part in launcher[:2]] != [sys.executable, "-m"]:
                return None
            args = [*launcher[1:], *args]
        if runs_fresh(env) or not args:
            return None
        if not (str(args[0]).endswith(".py") or (str(args[0]) == "-m" and len(args) > 1)):
            return None
        if cls._instance is None or cls._instance.process.poll() is not None:
            if cls._started_for == os.getpid():  # it died: this process runs fresh interpreters from now on
                return None
            cls._started_for = os.getpid()
            cls._instance = cls(cli_env())  # the suite's environment, not this command's: what forks is fixed
            import atexit
            atexit.register(cls._instance.close)
        return cls._instance if cls._instance.forks(env) else None

    def _reply(self, timeout):
        import select
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            if not select.select([self.process.stdout], [], [], max(0, deadline - time.monotonic()))[0]:
                raise subprocess.TimeoutExpired("fork server reply", timeout)
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError("the fork server exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, commands, envs, timeout, merge_stderr=False):
        """[subprocess.run(command, cwd=ROOT, env=env, stdin=DEVNULL, capture_output=True, text=True,
        timeout=timeout) for command, env in zip(commands, envs)], the commands running together, each
        in a fork of the server (if one fails, the server ends the others: fork_server.PEERS_GRACE_SECONDS).
        merge_stderr: stderr=subprocess.STDOUT instead (both streams append to one file, in order)."""
        with self.lock:
            outputs = [(os.path.join(self.outputs, f"{index}.stdout"),
                        os.path.join(self.outputs, f"{index}.{'stdout' if merge_stderr else 'stderr'}"))
                       for index in range(len(commands))]
            pids = self._send(commands, envs, outputs)
            try:
                returncodes = self._reply(timeout)["returncodes"]
            except subprocess.TimeoutExpired:
                for pid in pids:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                self._reply(60)
                raise subprocess.TimeoutExpired(commands[0], timeout) from None
            results = []
            for command, returncode, (out, err) in zip(commands, returncodes, outputs):
                with open(out) as fh_out, open(err) as fh_err:
                    results.append(subprocess.CompletedProcess(command, returncode, fh_out.read(),
                                                               "" if merge_stderr else fh_err.read()))
            return results

    def _send(self, commands, envs, outputs, session=False):
        """Ask for the commands (their output to the files `outputs`, created empty here; the
        children append to them); returns the children's pids."""
        for path in {str(path) for output in outputs for path in output}:
            open(path, "w").close()
        request = {"commands": [{"argv": [str(arg) for arg in command[1:]], "cwd": ROOT, "env": env,
                                 "stdout": str(out), "stderr": str(err), "session": session}
                                for command, env, (out, err) in zip(commands, envs, outputs)]}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        return self._reply(60)["pids"]

    def start(self, command, envs, stdout, stderr, store=None):
        """`command` forked once per environment of `envs` (the ranks of a process group, whose
        rendezvous `store` is kept until they end), each in a session of its own, all writing to
        the files `stdout` and `stderr`; returns a StartedCommand. The server is theirs until they
        have ended."""
        self.lock.acquire()
        try:
            pids = self._send([command] * len(envs), envs, [(stdout, stderr)] * len(envs), session=True)
        except BaseException:
            self.lock.release()
            raise

        def returncodes():
            try:
                codes = self._reply(0)["returncodes"]
            except subprocess.TimeoutExpired:
                return None
            self.lock.release()
            return codes
        return StartedCommand(pids, returncodes, store)

    def close(self):
        self.process.kill()
        shutil.rmtree(self.outputs, ignore_errors=True)


class StartedCommand:
    """What start_command returns, with what the tests use of subprocess.Popen: pid (rank 0's),
    poll(), wait(timeout), returncode (as group_returncode makes it of the ranks'), and `with`
    (which kills every rank still running, then waits); pids and returncodes, each rank's. Made
    with a function that gives the ranks' exit codes once all have ended, else None."""

    def __init__(self, pids, returncodes, store=None):
        self.pids, self.pid, self._returncodes, self.store = pids, pids[0], returncodes, store
        self.returncodes = self.returncode = None

    def poll(self):
        if self.returncodes is None:
            self.returncodes = self._returncodes()
            if self.returncodes is not None:
                self.returncode, self.store = group_returncode(self.returncodes), None
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.poll() is None:
            for pid in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.wait(60)


class FreshRanks:
    """Commands started together as subprocesses (the ranks of a process group) whose exit codes
    come as fork_server gives a request's: if one fails, the others have PEERS_GRACE_SECONDS to end
    on their own, then are killed. Its call gives the codes once all have ended, else None."""

    def __init__(self, processes):
        self.processes, self.failed_at = processes, None

    def __call__(self):
        codes = [process.poll() for process in self.processes]
        if self.failed_at is None and any(codes):
            self.failed_at = time.monotonic()
        if None not in codes:
            return codes
        if self.failed_at is not None and time.monotonic() - self.failed_at >= fork_server.PEERS_GRACE_SECONDS:
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return None


def group_returncode(returncodes) -> int:
    """The exit code of ranks that ended with `returncodes`: the first failing rank's that was not
    killed for another's failure (SIGKILL), else 0."""
    failed = [code for code in returncodes if code != 0]
    return next((code for code in failed if code != -signal.SIGKILL), failed[0] if failed else 0)


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
    """`command` (`python ...`, e.g. a launcher's `python -m torch.distributed.run ...`) started from
    the project root in a session of its own, as a job scheduler starts a job, with `env` as its whole
    environment and its output to the files `stdout` and `stderr`, for a test that signals it while
    it runs: a fork of the ForkServer where run_command would fork it, else a subprocess.Popen.
    ranks > 1: `python ARGS` as that many ranks of one process group (rank_environments), each in a
    session of its own as torch.distributed.run starts its ranks, writing to the same two files.
    Returns a StartedCommand."""
    envs, store = rank_environments(env, ranks)
    servers = {ForkServer.for_command(None, command[1:], rank_env) if str(command[0]) == sys.executable else None
               for rank_env in envs}
    with open(stdout, "w") as out, open(stderr, "w") as err:  # there (empty) from the start; each rank has them
        if None not in servers:
            return servers.pop().start(command, envs, stdout, stderr, store)
        processes = [subprocess.Popen(command, cwd=ROOT, env=rank_env, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=err, text=True, start_new_session=True) for rank_env in envs]
        return StartedCommand([process.pid for process in processes], FreshRanks(processes), store)


def run_command(args, env_dir, launcher=None, env=None, timeout=300, check=False, ranks=1, merge_stderr=False):
    """Run `launcher + args` (default launcher: this interpreter) from the project root in a fresh
    process with cli_env() updated by `env` (a None value unsets); returns CompletedProcess.
    `python SCRIPT ...` and `python -m MODULE ...` run as forks of the suite's ForkServer.
    merge_stderr: stderr into stdout, in the order they were written (subprocess.STDOUT, `2>&1`);
    the result's stderr is then "".

    ranks > 1: `python ARGS` as that many processes of one process group on this machine
    (rank_environments). For tests of what the ranks compute; the launchers themselves (torchrun,
    Slurm) are tested through them (test_multinode, test_preemption, test_slurm, test_fork_server).
    One CompletedProcess: the ranks' stdout and stderr in rank order, the failing rank's exit code
    (its peers are then ended: FreshRanks) and `returncodes`, each rank's."""
    command = (launcher or [sys.executable]) + [str(arg) for arg in args]
    merged = {k: v for k, v in {**cli_env(), **(env or {})}.items() if v is not None}  # None unsets
    if merged.get("HF_HUB_OFFLINE") != "1" and "HF_HOME" not in (env or {}):
        merged["HF_HOME"] = str(env_dir / "hf_home")  # what a command downloads stays in its test
    assert ranks == 1 or launcher is None, "ranks start as `python ARGS`"
    envs, store = rank_environments(merged, ranks)
    servers = {ForkServer.for_command(launcher, args, rank_env) for rank_env in envs}
    if None not in servers:
        results = servers.pop().run([command] * ranks, envs, timeout, merge_stderr)
    else:
        results = run_fresh([command] * ranks, envs, timeout, merge_stderr)
    del store
    result = subprocess.CompletedProcess(command, group_returncode([result.returncode for result in results]),
                                         "".join(result.stdout for result in results),
                                         "".join(result.stderr for result in results))
    result.returncodes = [each.returncode for each in results]
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def run_fresh(commands, envs, timeout, merge_stderr=False):
    """ForkServer.run in fresh interpreters: [subprocess.run(command, cwd=ROOT, env=env,
    stdin=DEVNULL, capture_output=True, text=True, timeout=timeout)], the commands running together
    (if one fails, the others are ended: FreshRanks)."""
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as files:  # closed also on a timeout
        outputs = [tuple(files.enter_context(open(os.path.join(folder, f"{index}.{stream}"), "w+"))
                         for stream in ("stdout", "stderr")) for index in range(len(commands))]
        processes = [subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT if merge_stderr else err, text=True)
                     for command, env, (out, err) in zip(commands, envs, outputs)]
        returncodes, deadline = FreshRanks(processes), time.monotonic() + timeout
        while returncodes() is None:
            if time.monotonic() > deadline:
                for process in processes:
                    process.kill()
                    process.wait()
                raise subprocess.TimeoutExpired(commands[0], timeout)
            time.sleep(0.05)
        results = []
        for command, process, (out, err) in zip(commands, processes, outputs):
            out.seek(0), err.seek(0)
            results.append(subprocess.CompletedProcess(command, process.returncode, out.read(), err.read()))
        return results


@pytest.fixture
def run_cli(tmp_path):
    """run_cli(args, ...): run_command with this test's tmp_path as env_dir (from the project root,
    forked where a fork runs as a fresh interpreter would); returns CompletedProcess."""
    return functools.partial(run_command, env_dir=tmp_path)


def run_training(env_dir, recipe, output_dir, *flags, script="train_ddpm.py", launcher=None, env=None, timeout=300,
                 check=True, ranks=1):
    """The training command line on a recipe, run by run_command; returns CompletedProcess.

    Flags may be numbers or paths. A non-zero exit fails the test unless check=False (for tests
    of a refusal). script: a test-only wrapper of train_ddpm.py (tests/*_train.py); launcher: e.g.
    torch.distributed.run; env: variables set (None: unset) on top of the clean test environment;
    ranks: run_command's (a process group of that many ranks on this machine, no launcher)."""
    return run_command([script, "--config", recipe, "--output_dir", output_dir, *flags], env_dir,
                       launcher=launcher, env=env, timeout=timeout, check=check, ranks=ranks)


@pytest.fixture
def train(tmp_path):
    """train(recipe, output_dir, *flags, ...): run_training in this test's environment."""
    return functools.partial(run_training, tmp_path)


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory):
    """The output folder of the tiny recipe trained 3 steps (seed 0, no other flag), trained once per
    session (per xdist worker) for the tests that compare a run with it. Read it, never write it."""
    folder = tmp_path_factory.mktemp("tiny_reference_run")
    run_training(folder, write_tiny_recipe(folder), folder / "run", "--max_train_steps", 3)
    return folder / "run"


@pytest.fixture
def hooked_train(train):
    """train() through tests/hooked_train.py, which injects the failures its DDPM_TEST_* variables name."""
    return functools.partial(train, script=HOOKED_TRAIN)


def slow_set_epoch(seconds: float):
    """A stand-in for datasets' IterableDataset.set_epoch, which does `self._epoch += epoch - self._epoch`
    on a tensor in shared memory that all DataLoader workers of a process share: a read-modify-write.
    This one reads, waits `seconds`, then writes, so workers that set the epoch together race every
    time (issue 21). Patched in before the workers fork, it holds in them."""
    def set_epoch_slowly(self, epoch):
        delta = epoch - self._epoch
        time.sleep(seconds)
        self._epoch += delta
    return set_epoch_slowly


@pytest.fixture
def parquet_images(tmp_path):
    """40 grey images of 10x12 whose pixel value is their row index, in 4 parquet shards."""
    import datasets
    import numpy as np
    from PIL import Image
    folder = tmp_path / "pq"
    folder.mkdir()
    images = [Image.fromarray(np.full((10, 12), i * 5, np.uint8)) for i in range(40)]
    features = datasets.Features({"img": datasets.Image(), "n": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict({"img": images, "n": list(range(40))}, features=features)
    for k in range(4):
        dataset.shard(4, k).to_parquet(str(folder / f"part-{k}.parquet"))
    return str(folder)


@pytest.fixture
def fresh_accelerate():
    """Each in-process run gets its own accelerate state (it is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True), GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True), GradientState._reset_state()


def tiny_run(tmp_path, *flags, hooks=None, output_dir=None, **recipe):
    """An in-process run set up (training.build.setup) from TINY_RECIPE with `recipe` overrides and
    `flags`, in `output_dir` (default tmp_path/run), with `hooks` (training.hooks.Hooks); use with
    the fresh_accelerate fixture."""
    from diffusion_extras.training import build
    from diffusion_extras.training.config import parse_config
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **recipe}))
    return build.setup(parse_config(["--config", str(path), "--output_dir", str(output_dir or tmp_path / "run"),
                                     *map(str, flags)]), hooks)


def dynamo_counts() -> dict:
    """torch.compile's tallies in this process so far (torch._dynamo.utils.counters): graphs
    captured, graph breaks, and frames compiled (a recompile compiles a frame again)."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "frames": counters["frames"]["total"]}


def tiny_unet(channels: int = 1, sample_size: int = TINY_RECIPE["resolution"], seed: int = 0, **overrides):
    """The TINY_RECIPE UNet as a diffusers model (initialised from torch.manual_seed(seed)), for
    tests that need one without a training run; keyword arguments override its architecture."""
    import torch
    from diffusers import UNet2DModel
    torch.manual_seed(seed)
    architecture = {**TINY_RECIPE["model"], "in_channels": channels, "out_channels": channels, **overrides}
    return UNet2DModel(sample_size=sample_size, **architecture)


def save_tiny_pipeline(path, channels: int = 1) -> str:
    """A tiny_unet DDPMPipeline saved like a training output folder, with the files training
    leaves beside it (a checkpoint, samples, a model card) that loading must ignore."""
    from diffusers import DDPMPipeline, DDPMScheduler
    pipeline = DDPMPipeline(unet=tiny_unet(channels=channels), scheduler=DDPMScheduler(num_train_timesteps=100))
    pipeline.save_pretrained(path)
    os.makedirs(os.path.join(path, "checkpoint-10"))
    os.makedirs(os.path.join(path, "samples"))
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("model card")
    return str(path)


def read_history(output_dir) -> list:
    with open(os.path.join(output_dir, "logs", "history.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_unet_weights(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "unet", "diffusion_pytorch_model.safetensors"))


def load_bench_module(name: str):
    """bench/<name>.py as a module (bench/ holds scripts, not a package), loaded once."""
    import importlib.util
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMMAND_FIXTURES = {"run_cli", "train", "hooked_train", "tiny_reference_run"}  # they run the command line


def source_of(function) -> str:
    """The source text of a test or fixture function ("" where there is none)."""
    import inspect
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def test_fixtures(item) -> list:
    """The functions of the fixtures a test uses that are defined in its module."""
    return [definitions[-1].func for definitions in item._fixtureinfo.name2fixturedefs.values()
            if definitions and definitions[-1].func.__module__ == item.module.__name__]


def starts_a_command(item) -> bool:
    """The test runs a command (run_command, directly or through a fixture, or a fixture of its module
    that trains through the command line): it is a test of the command-line contract (marker `cli`)."""
    if COMMAND_FIXTURES & set(item.fixturenames):
        return True
    return any(map(names_a_runner, [getattr(item, "function", None), *test_fixtures(item)]))


# What a command's exit code and error output are read as (`merge_stderr`, stderr in the stdout a test
# reads, contains "stderr"). A test that reads only stdout is no contract test: a fork prints what a
# fresh interpreter prints there (a preloaded import that printed to stdout would break the server's
# replies, which go through it; test_fork_server compares the stdout of a training run, forked and fresh).
CONTRACT_WORDS = ("returncode", "stderr")


RUNNER_NAMES = {"run_command", "run_training", "start_command"}  # this file's functions that start a command


def code_names(function) -> set:
    """The global and attribute names that `function`'s code, and the code of functions nested in
    it, use (a call, or a runner handed on: functools.partial(run_training, ...))."""
    import inspect
    codes, names = [getattr(function, "__code__", None)], set()
    for code in filter(None, codes):
        names.update(code.co_names)
        codes += [const for const in code.co_consts if inspect.iscode(const)]
    return names


@functools.cache  # asked at collection for each test and at every fixture set-up
def reached(function) -> tuple:
    """`function` and the helpers it calls that are functions of a tests/test_*.py file (its module's
    or imported from another), followed through the helpers' own calls (test_preemption's
    assert_preempted_at reads the exit code for its tests). This file's runners are not followed:
    they read the exit code for every test (check=True)."""
    import inspect
    seen, todo = set(), [function]
    while todo:
        function = todo.pop()
        if function in seen:
            continue
        seen.add(function)
        for name in code_names(function):
            helper = getattr(function, "__globals__", {}).get(name)
            if inspect.isfunction(helper) and os.path.basename(inspect.getfile(helper)).startswith("test_"):
                todo.append(helper)
    return tuple(seen)


@functools.cache  # asked at every fixture set-up
def reads_what_a_command_printed(function) -> bool:
    """The source of the test function, or of a helper it reaches, names CONTRACT_WORDS (it reads a
    command's exit code or stderr)."""
    return any(word in source_of(each) for each in reached(function) for word in CONTRACT_WORDS)


@functools.cache
def names_a_runner(function) -> bool:
    """The test function, or a helper it reaches, starts a command with one of RUNNER_NAMES."""
    return any(RUNNER_NAMES & code_names(each) for each in reached(function))


# Modules whose tests take tens of seconds each, longest first (the Slurm jobs mostly wait for the
# scheduler). They start first, and the short in-process tests fill the workers' last minutes.
LONG_FIRST = ("test_slurm", "test_compile", "test_multinode", "test_bench_quality", "test_preemption",
              "test_fork_server", "test_stream_workers")


def start_order(item) -> tuple:
    module = item.module.__name__
    return (LONG_FIRST.index(module) if module in LONG_FIRST else len(LONG_FIRST),
            item.get_closest_marker("cli") is None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks (pyproject: --dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Tests that start a command are marked `cli`; those of them that read its exit code or stderr,
    or use a fixture of their module that does (reads_what_a_command_printed), are also marked
    `contract`.
    Tests that read one module-scoped fixture of their module (most are a training run made once
    and read by several tests) run on one xdist worker, so it is made once, not once per worker.
    Module-scoped fixtures of this file group nothing.
    The order (start_order): the long modules first, then the other command-line tests, then the
    in-process ones; a module's tests keep their order (pyproject: --no-loadscope-reorder)."""
    for item in items:
        if starts_a_command(item):
            item.add_marker(pytest.mark.cli)
            if any(map(reads_what_a_command_printed, [getattr(item, "function", None), *test_fixtures(item)])):
                item.add_marker(pytest.mark.contract)
        for name in item.fixturenames:
            definitions = item._fixtureinfo.name2fixturedefs.get(name)
            if (definitions and definitions[-1].scope == "module"
                    and definitions[-1].func.__module__ == item.module.__name__):
                item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{name}"))
                break
    items.sort(key=start_order)
