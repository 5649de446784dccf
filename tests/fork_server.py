"""One interpreter that has imported the heavy libraries, forked for each command a test runs.

A tiny training run spends most of its time importing torch, diffusers, transformers, scipy,
scikit-learn, matplotlib, pandas and pyarrow, and the suite runs a few hundred commands. This
server imports them once (PRELOADED); each `python SCRIPT ARGS` or `python -m MODULE ARGS` sent to
it runs in a fork, set up as the interpreter sets up a script (argv, sys.path[0], working directory,
environment, standard streams, fresh random seeds), and ended by the interpreter itself: whatever
ends the command (its end, sys.exit, an exception, Ctrl-C) leaves this module's top level as it
would leave the script's, so CPython prints it, joins threads, runs atexit, flushes and exits with
the code a fresh interpreter would.

It is sound by refusal, never by repair. While it imports, the server records which environment
variables the imports read, and whether they printed anything or started a thread. The client
(conftest.ForkServer) forks a command only when its values of those variables and of what the
interpreter reads at start-up (START_UP_VARIABLES) equal the server's, and when the imports were
silent and single-threaded; any other command runs in a real subprocess, as does every command
under DDPM_TEST_FRESH_INTERPRETERS=1 (under =contract, those of the tests marked `contract` and of
the fixtures that read a command's exit code or stderr: conftest.runs_fresh).
`python -m torch.distributed.run` is a command like any other; the ranks it starts are real
`python` processes, fresh interpreters. The one thing a fork cannot give a fresh value is the
string hash seed: conftest.cli_env fixes PYTHONHASHSEED for both kinds of run.

Several commands may run together: the ranks of a process group (conftest.run_command's ranks), each a
`python SCRIPT` with its RANK and the group's rendezvous in its environment, as a launcher would
start them. If one ends with a non-zero code, the others have PEERS_GRACE_SECONDS to end on their own
(rank 0 printing the line its peers leave to it), then are killed, so a test sees the failing rank's
error rather than its peers waiting for it in a collective.

Protocol (JSON lines on stdin/stdout, one request at a time): the server replies {"ready": true,
"read": {variable: value or null}, "set": {variable: value}, "printed": text, "threads": n}; the
client sends {"commands": [{"argv": [...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path,
"session": bool}, ...]} (session: the child starts a session of its own, for a test that signals
its process group, conftest.start_command; the client creates the output files, each child appends
to its own, so ranks may share them); the server forks one child per command, replies
{"pids": [...]}, waits for them all, and replies {"returncodes": [...]} (negative: the ending
signal). tests/test_fork_server.py runs commands both ways and compares what the tests read.
"""
import gc
import importlib
import json
import os
import random
import runpy
import signal
import sys
import tempfile
import threading
import time

# Read by the interpreter or a preloaded library at start-up without passing through os.environ.
START_UP_VARIABLES = ("PYTHONHASHSEED", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE",
                      "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONUNBUFFERED",
                      "OMP_NUM_THREADS",
                      "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH")
PEERS_GRACE_SECONDS = 2.0  # after a rank's failure, before its peers still running are killed
# The libraries a training, sampling or evaluation run imports, then this package's modules of a
# training run (its evaluation and monitoring included): they read no variable at import either.
PRELOADED = ("numpy", "torch", "torch.nn.functional", "torch._dynamo", "sympy", "scipy.linalg", "scipy.stats",
             "sklearn.datasets", "sklearn.linear_model", "matplotlib.figure", "matplotlib.backends.backend_agg",
             "pandas", "pyarrow", "pyarrow.compute", "pyarrow.dataset", "PIL.Image", "yaml", "safetensors.torch",
             "tqdm", "requests", "huggingface_hub", "datasets", "datasets.packaged_modules.imagefolder",
             "datasets.packaged_modules.parquet", "datasets.packaged_modules.webdataset", "accelerate",
             "torchdata.stateful_dataloader",
             "diffusers.models.unets.unet_2d", "diffusers.schedulers.scheduling_ddpm",
             "diffusers.schedulers.scheduling_ddim", "diffusers.schedulers.scheduling_dpmsolver_multistep",
             "diffusers.pipelines.ddpm.pipeline_ddpm", "diffusers.pipelines.pipeline_utils", "diffusers.optimization",
             "transformers", "diffusion_extras.training.main", "diffusion_extras.training.build",
             "diffusion_extras.training.loop")


FRAMES_OF_ENVIRON = ("os", "_collections_abc", "collections.abc")  # os.environ's own frames
# Modules that scan the whole environment at import but use only the variables of their prefix.
SCANS = {"tqdm.utils": "TQDM_", "fsspec.config": "FSSPEC_"}


class RecordingEnviron(type(os.environ)):
    """os.environ that records every variable an import looks up (in the server, while it preloads)."""
    names = set()

    def _record(self, key):
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") in FRAMES_OF_ENVIRON:
            frame = frame.f_back
        prefix = SCANS.get(frame.f_globals.get("__name__") if frame is not None else None, "")
        if key.startswith(prefix):
            RecordingEnviron.names.add(key)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def preload() -> dict:
    """Import PRELOADED with os.environ recording and stderr captured; returns the "ready" reply."""
    real, before = os.environ, dict(os.environ)
    os.environ = RecordingEnviron(real._data, real.encodekey, real.decodekey, real.encodevalue,  # noqa: B003
                                  real.decodevalue)
    saved_stderr = os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 2)
        gc.disable()  # as the commands import (diffusion_extras.core.commands.importing_the_stack)
        try:
            for name in PRELOADED:
                importlib.import_module(name)
        finally:
            gc.enable()  # a child starts with the collector on, as a fresh interpreter does
            sys.stderr.flush()
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            os.environ = real  # noqa: B003
        printed.seek(0)
        text = printed.read().decode(errors="replace")
    return {"ready": True, "read": {name: before.get(name) for name in sorted(RecordingEnviron.names)},
            "set": {name: value for name, value in os.environ.items() if before.get(name) != value},
            "printed": text, "threads": threading.active_count()}


def run(request: dict, set_by_imports: dict, generators: list) -> None:
    """In the forked child: start as `python ARGV` would and run it. It never returns: the command's
    end is raised from here (SystemExit(0) when it simply finishes). The variables the preloaded
    imports set (torch sets some) are set as those imports would set them in a fresh interpreter."""
    if request.get("session"):  # started as a job scheduler starts a job (subprocess's start_new_session)
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)  # as ranks that share their launcher's files
    sys.stdout = sys.__stdout__
    # a fresh interpreter seeds its generators from the OS: random's, numpy's global one, torch's
    # default one, and the random.Random objects libraries make at import (datasets' fingerprints)
    for generator in generators:
        generator.seed()
    sys.modules["numpy"].random.seed()
    sys.modules["torch"].seed()
    argv = request["argv"]
    if not (finds_module(argv[1]) if argv[0] == "-m" else os.path.exists(argv[0])):
        # the interpreter's own refusal ("can't open file", "No module named"), exit code and all
        os.execv(sys.executable, [sys.executable, *argv])
    if argv[0] == "-m":  # python -m MODULE ARGS: sys.path[0] is the working directory
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # python SCRIPT ARGS: sys.path[0] is the script's folder
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)


def finds_module(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its package is missing
        return False


def import_time_generators() -> list:
    """The random.Random objects the preloaded modules hold (random's own, datasets' fingerprint
    generator...). Found once, here: a child that walked every module's values itself would write
    to each value's reference count, copying ~110 MB of the server's pages per fork (measured:
    0.15 CPU-s and 27,000 page faults for a command that does nothing)."""
    return [value for module in list(sys.modules.values()) for value in list(getattr(module, "__dict__", {}).values())
            if type(value) is random.Random]


def serve() -> None:
    ready = preload()
    generators = import_time_generators()
    # The gc module's recipe for a process that forks without exec: what the imports left is
    # collected, and the rest moved out of the collector's sight, so a child neither copies those
    # pages by touching them nor spends ~2 s at exit collecting them (measured: 2.2 s -> 0.45 s).
    # What a child skips is collecting cycles among the server's import-time objects when it
    # exits, whose finalizers CPython does not promise to run at exit anyway.
    gc.collect()
    gc.freeze()
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol pipe
    print(json.dumps(ready), file=replies, flush=True)
    for line in sys.stdin:
        pids = []
        for command in json.loads(line)["commands"]:
            pid = os.fork()
            if pid == 0:
                run(command, ready["set"], generators)
            pids.append(pid)
        print(json.dumps({"pids": pids}), file=replies, flush=True)
        returncodes, failed_at, killed = {}, None, False
        while len(returncodes) < len(pids):
            pid, status = os.waitpid(-1, os.WNOHANG if failed_at is not None and not killed else 0)
            if pid:
                returncodes[pid] = os.waitstatus_to_exitcode(status)
                if returncodes[pid] != 0 and failed_at is None:  # its peers may wait for it in a collective
                    failed_at = time.monotonic()
            elif time.monotonic() - failed_at < PEERS_GRACE_SECONDS:
                time.sleep(0.01)
            else:
                for other in set(pids) - set(returncodes):
                    os.kill(other, signal.SIGKILL)
                killed = True
        print(json.dumps({"returncodes": [returncodes[pid] for pid in pids]}), file=replies, flush=True)


if __name__ == "__main__":
    serve()
