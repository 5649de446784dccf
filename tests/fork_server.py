"""A fork server for the suite's command-line runs: each `python SCRIPT ARGS` a test runs is a
forked copy of one interpreter that has already imported the heavy third-party libraries.

Why: a tiny training run spends most of its wall time importing torch, torch._dynamo (via
diffusers), scipy, scikit-learn, matplotlib, pandas and pyarrow, and the suite runs a few hundred
of them. The child is still a process of its own running the real entry point: its own argv,
environment, working directory, stdout/stderr, exit code (or -signal), and a fresh import of this
project and of every library that reads the environment at import (huggingface_hub, datasets,
diffusers, transformers, accelerate, wandb: none of them is preloaded, so HF_HOME, HF_HUB_OFFLINE,
HF_ENDPOINT, ... are read by the child as a new interpreter would read them).

Only what an interpreter fixes at start-up is shared, so conftest.run_command sends a command here
only when that matches (PYTHONHASHSEED, OMP/MKL threads, PYTHONPATH, ...: START_UP_VARIABLES) and
falls back to a real subprocess otherwise (launchers such as torch.distributed.run, `-c`, other
interpreters). DDPM_TEST_FRESH_INTERPRETERS=1 sends every command to a real subprocess.

Protocol (one request at a time, JSON lines on stdin/stdout): the client sends
{"argv": [...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path}; the server forks, replies
{"pid": ...}, waits, and replies {"returncode": ...} (negative: the signal that ended the child).
"""
import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import traceback

# Read by the interpreter or a preloaded library at start-up: a command whose values differ from
# the server's cannot be forked from it.
START_UP_VARIABLES = ("PYTHONHASHSEED", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE",
                      "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONUTF8", "PYTHONIOENCODING", "OMP_NUM_THREADS",
                      "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH", "MPLBACKEND",
                      "MPLCONFIGDIR")
# Libraries that read no variable a test changes when imported. Importing them does not start
# threads (an OpenMP pool starts at the first parallel op), so forking after it is safe.
PRELOADED = ("numpy", "torch", "torch.nn.functional", "torch._dynamo", "sympy", "scipy.linalg", "scipy.stats",
             "sklearn.datasets", "sklearn.linear_model", "matplotlib.figure", "matplotlib.backends.backend_agg",
             "pandas", "pyarrow", "pyarrow.compute", "pyarrow.dataset", "PIL.Image", "yaml",
             "safetensors.torch", "tqdm", "requests")


def start_up_key(env: dict) -> tuple:
    return tuple(env.get(name) for name in START_UP_VARIABLES)


def run_child(request: dict) -> None:
    """In the forked child: become `python argv...` and never return."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name in ("SIGTERM", "SIGUSR1", "SIGHUP", "SIGPIPE"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        argv = request["argv"]
        sys.argv = list(argv)
        try:
            if argv[0] == "-m":  # python -m module args: sys.path[0] is the working directory
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # python script args: sys.path[0] is the script's folder
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:  # sys.exit("message"): the interpreter prints it and exits with 1
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException as error:
            traceback.print_exc()
            code = 130 if isinstance(error, KeyboardInterrupt) else 1
        # what an interpreter does at exit: join non-daemon threads, run atexit, flush
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol pipe
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sys.stdout = sys.__stdout__ = reply  # fd 1, pointed at the child's stdout file by run_child
            run_child(request)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"returncode": returncode}), file=reply, flush=True)


if __name__ == "__main__":
    serve()
