"""A fork server for the suite's command-line runs: each `python SCRIPT ARGS` a test runs is a
forked copy of one interpreter that has already imported the heavy third-party libraries.

Why: a tiny training run spends most of its wall time importing torch, torch._dynamo, diffusers
(which pulls in transformers), datasets, accelerate, scipy, scikit-learn, matplotlib, pandas and
pyarrow, and the suite runs a few hundred of them. The child is still a process of its own running
the real entry point: its own argv, environment, working directory, stdout/stderr, exit code (or
-signal), and a fresh import of this project.

What an import read from the environment must be what the child's environment says. While it
preloads, the server records which variables each module reads at import (a tracing os.environ).
Six modules turn the Hugging Face variables a test sets (HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT,
HF_DATASETS_CACHE, HF_MODULES_CACHE, ...) into module values (REREAD): a child whose values differ
runs them again in scratch modules under its own environment and puts every plain value that
changed in place, in those modules, wherever another module imported it by name, and in function
defaults (reread_environment_values). Every other
variable read at import is fixed: conftest.run_command sends a command here only when its values of
those, and of what the interpreter itself reads at start-up (START_UP_VARIABLES), equal the
server's, and runs a real subprocess otherwise (as for launchers such as torch.distributed.run,
`-c`, or DDPM_TEST_FRESH_INTERPRETERS=1). tests/test_fork_server.py checks that a forked child's
module values equal a fresh interpreter's under other HF_* values.

Protocol (one request at a time, JSON lines on stdin/stdout): the server first replies {"ready":
true, "fixed": {variable: value or null}, "set_by_imports": {variable: value}}; the client sends
{"argv": [...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path}; the server forks, replies
{"pid": ...}, waits, and replies {"returncode": ...} (negative: the signal that ended the child).

`python -m torch.distributed.run ...` is forked too, and so are its workers: in that child, torch's
SubprocessHandler starts each `python -u SCRIPT ARGS` worker as a fork of the launcher, run as a
command is run here (fork_the_launchers_workers).
"""
import atexit
import collections
import importlib
import importlib.util
import io
import json
import logging
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import types

# Read by the interpreter or a preloaded library at start-up: a command whose values differ from
# the server's cannot be forked from it.
START_UP_VARIABLES = ("PYTHONHASHSEED", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE",
                      "PYTHONOPTIMIZE", "PYTHONWARNINGS", "PYTHONUTF8", "PYTHONIOENCODING", "OMP_NUM_THREADS",
                      "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH", "MPLBACKEND",
                      "MPLCONFIGDIR")
# Imported once by the server: the libraries a training, sampling or evaluation run imports.
PRELOADED = ("numpy", "torch", "torch.nn.functional", "torch._dynamo", "sympy", "scipy.linalg", "scipy.stats",
             "sklearn.datasets", "sklearn.linear_model", "matplotlib.figure", "matplotlib.backends.backend_agg",
             "pandas", "pyarrow", "pyarrow.compute", "pyarrow.dataset", "PIL.Image", "yaml",
             "safetensors.torch", "tqdm", "requests", "huggingface_hub", "datasets",
             "datasets.packaged_modules.imagefolder", "datasets.packaged_modules.parquet",
             "datasets.packaged_modules.webdataset", "accelerate", "torchdata.stateful_dataloader",
             "diffusers.models.unets.unet_2d", "diffusers.schedulers.scheduling_ddpm",
             "diffusers.schedulers.scheduling_ddim", "diffusers.schedulers.scheduling_dpmsolver_multistep",
             "diffusers.pipelines.ddpm.pipeline_ddpm", "diffusers.pipelines.pipeline_utils", "diffusers.optimization",
             "transformers", "torch.distributed.run")
# Modules whose module-level values come from Hugging Face variables a test sets; a child re-reads them.
# In order: huggingface_hub.utils._http reads none itself but derives _HUB_ORIGINS from the constants.
REREAD = ("huggingface_hub.constants", "huggingface_hub.utils._http", "datasets.config", "diffusers.utils.constants",
          "transformers.utils.hub", "accelerate.commands.config.config_args")
LAUNCHER = "torch.distributed.run"  # a command `python -m torch.distributed.run ...` forks its workers too
# Modules that scan the whole environment at import for variables of their own prefix.
SCANS = {"tqdm.utils": "TQDM_", "fsspec.config": "FSSPEC_"}
FRAMES_OF_ENVIRON = ("os", "_collections_abc", "collections.abc")
_ABSENT = object()


class TracingEnviron(type(os.environ)):
    """os.environ that records, while `recording`, which module read which variable."""
    recording = False
    reads = collections.defaultdict(set)

    def _record(self, key):
        if TracingEnviron.recording:
            frame = sys._getframe(2)
            while frame is not None and frame.f_globals.get("__name__") in FRAMES_OF_ENVIRON:
                frame = frame.f_back
            module = frame.f_globals.get("__name__") if frame is not None else None
            prefix = SCANS.get(module)
            if prefix is None or key.startswith(prefix):
                TracingEnviron.reads[module].add(key)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def preload() -> tuple[dict, dict, dict]:
    """Import PRELOADED. Returns the environment they were imported in; {variable: value or None}
    of every variable read at import by a module other than REREAD's (the values a child's
    environment must have to be forked); and the variables the imports set themselves (torch sets
    TORCHINDUCTOR_CACHE_DIR, ...), which a fresh interpreter's environment would hold too."""
    real = os.environ
    start = dict(real)
    os.environ = TracingEnviron(real._data, real.encodekey, real.decodekey,  # noqa: B003 (the same variables)
                                real.encodevalue, real.decodevalue)
    TracingEnviron.recording = True
    try:
        for name in PRELOADED:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    finally:
        TracingEnviron.recording = False
        os.environ = real  # noqa: B003
    fixed = {key for module, keys in TracingEnviron.reads.items() if module not in REREAD for key in keys}
    set_by_imports = {key: value for key, value in os.environ.items() if start.get(key) != value}
    return start, {key: start.get(key) for key in sorted(fixed)}, set_by_imports


def reread_environment_values(read_in: dict) -> None:
    """In a child whose values of REREAD's variables differ from `read_in` (the environment the
    process it was forked from read them in): each REREAD module
    runs again, in order, in a scratch module under the child's environment, and each plain value
    (str, number, path, or a container of them) that came out different replaces the old object
    wherever it is: in the module, in any module holding it under the same name (`from .constants
    import X`), and as a default argument of a module-level function (`def f(path=CONSTANT)`)."""
    keys = {key for name in REREAD for key in TracingEnviron.reads.get(name, ())}
    if all(os.environ.get(key) == read_in.get(key) for key in keys):
        return
    changed = []
    for name in REREAD:
        module = sys.modules.get(name)
        if module is None:
            continue
        scratch = importlib.util.module_from_spec(module.__spec__)
        module.__spec__.loader.exec_module(scratch)
        for key, value in vars(scratch).items():
            old = vars(module).get(key, _ABSENT)
            if not key.startswith("__") and plain(value) and old is not _ABSENT and _differs(old, value):
                setattr(module, key, value)  # now: the next REREAD module may derive from it
                changed.append((key, old, value))
    # by identity only objects made at import (paths, URLs), never shared singletons (True, None, 1)
    replacements = {id(old): value for _, old, value in changed if isinstance(old, (str, pathlib.PurePath))}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, old, value in changed:
            if namespace.get(key, _ABSENT) is old:
                namespace[key] = value
        for item in list(namespace.values()):
            # type(), not isinstance: isinstance reads __class__, which some module attributes
            # answer with a deprecation warning (torch.distributed.reduce_op) a fresh run never prints
            if type(item) is types.FunctionType and item.__defaults__:
                if any(id(default) in replacements for default in item.__defaults__):
                    item.__defaults__ = tuple(replacements.get(id(d), d) for d in item.__defaults__)


def plain(value, depth: int = 0) -> bool:
    """A value made of str, numbers, None, paths and (two levels of) containers of them."""
    if type(value) in (str, int, float, bool, type(None)) or isinstance(value, pathlib.PurePath):
        return True
    if depth < 2 and type(value) in (tuple, list, set, frozenset):
        return all(plain(item, depth + 1) for item in value)
    if depth < 2 and type(value) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:
        return True


def start_up_key(env: dict) -> tuple:
    return tuple(env.get(name) for name in START_UP_VARIABLES)


def run_child(request: dict, read_in: dict, set_by_imports: dict, unbuffered: bool = False) -> None:
    """In the forked child: become `python argv...` and never return. Without "stdout"/"stderr"
    paths in the request, the standard streams are those the child was given (a worker's)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name in ("SIGTERM", "SIGUSR1", "SIGHUP"):  # (SIGPIPE stays ignored, as CPython sets it at start-up)
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**set_by_imports, **request["env"]})
        reread_environment_values(read_in)
        if "stdout" in request:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        if unbuffered:  # python -u
            sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
            sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        argv = request["argv"]
        sys.argv = list(argv)
        if argv[:2] == ["-m", LAUNCHER]:
            fork_the_launchers_workers(set_by_imports)
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


def fork_the_launchers_workers(set_by_imports: dict) -> None:
    """In a child running torch.distributed.run: its workers (`python -u SCRIPT ARGS`, started by
    torch's SubprocessHandler with subprocess.Popen in a new session) are forks of this process
    run as run_child runs a command, each in its own session with the streams torch gives it. What
    the launcher adds after this point (atexit handlers, root log handlers) is not the workers'."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    launcher_exit_handlers = []
    register = atexit.register

    def recording_register(function, *args, **kwargs):
        launcher_exit_handlers.append(function)
        return register(function, *args, **kwargs)

    atexit.register = recording_register
    root_handlers = list(logging.getLogger().handlers)
    read_in = dict(os.environ)  # the launcher has read its values in this environment: workers that share it skip

    class WorkerPopen(subprocess.Popen):
        def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                           creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
            args = [str(arg) for arg in args]
            if args[0] != sys.executable or shell or executable is not None:
                return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                              startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                              c2pwrite, errread, errwrite, *rest)
            pid = os.fork()
            if pid == 0:
                try:
                    os.setsid()
                    for fd, target in ((0, p2cread), (1, c2pwrite), (2, errwrite)):
                        if target != -1:
                            os.dup2(target, fd)
                    atexit.register = register
                    for function in launcher_exit_handlers:
                        atexit.unregister(function)
                    logging.getLogger().handlers[:] = root_handlers
                    argv, unbuffered = args[1:], args[1:2] == ["-u"]
                    run_child({"argv": argv[1:] if unbuffered else argv, "cwd": cwd or os.getcwd(),
                               "env": dict(env if env is not None else os.environ)},
                              read_in, set_by_imports, unbuffered)
                finally:
                    os._exit(1)
            self.pid, self._child_created = pid, True
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    subprocess_handler.Popen = WorkerPopen


def serve() -> None:
    server_environment, fixed, set_by_imports = preload()
    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol pipe
    print(json.dumps({"ready": True, "fixed": fixed, "set_by_imports": set_by_imports}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sys.stdout = sys.__stdout__ = reply  # fd 1, pointed at the child's stdout file by run_child
            run_child(request, server_environment, set_by_imports)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"returncode": returncode}), file=reply, flush=True)


if __name__ == "__main__":
    serve()
