"""Faults and probes for the trainer's extension points (diffusion_extras.training.hooks), by name.

In the test process:   run_training(recipe, out, hooks=faults.hooks(stop_after_checkpoint=3))
In processes of their own (several ranks, a launcher, Slurm, a kill from outside):
                       python tests/faults.py --stop_after_checkpoint 3 -- <train_ddpm.py's flags>
                       (processes.launch_training(..., faults=("--stop_after_checkpoint", 3)))

Each keyword of `hooks` is one fault or probe:
stop_after_checkpoint=N  the run dies right after checkpoint N is complete, before any later work
                         (a process ends at once with os._exit; in the test process ProcessDied is
                         raised, which the trainer does not catch): preemption at a checkpoint boundary.
sigkill_in_save=N        SIGKILL while checkpoint N is being completed (files written, no marker yet).
                         Processes only.
nan_at_steps=(a, b)      the model inputs of those optimizer steps (1-based) are NaN.
signal_at_step=N         after optimizer step N the process sends itself SIGTERM (signal_name: another,
                         signal_ranks: only those ranks): a preemption at a chosen step.
signal_in_save=N         a SIGTERM while checkpoint N is being completed (a second signal during the save).
enospc_at=(WHAT, N)      OSError(ENOSPC) at the first guarded write WHAT ("checkpoint", "pipeline export",
                         "sample grid", "log history") at or after step N; "checkpoint" fails mid-save
                         (files written, no marker yet).
signal_in_setup=True     a SIGTERM while the run is being set up (as its data source is built), before the
                         loop: a scheduler's signal during start-up.
fill_disk_in_save=(N, PATH)  while checkpoint N is being completed, PATH grows until the disk is full.
fill_disk_at=(WHAT, N, PATH) at the first guarded write WHAT at or after step N, PATH grows until the disk
                         is full: that write then creates its files and meets a real ENOSPC.
record_labels=PATH       each training forward appends {"rank", "micro_step", "means": the clean images'
                         mean pixel in [-1, 1], "labels": the class labels the UNet is given} to PATH.
step_seconds=S           in a run that starts from step 0, each optimizer step is followed by a sleep of
                         S seconds: a slow job a scheduler stops (test_slurm). Its resumption is not slowed.
dynamo_counts=DIR        after each optimizer step (and, as a process, at its end: "end"), torch.compile's
                         tallies as a line of DIR/rank<i>.jsonl.
data_source=CLASS        a data source of the trainer's interface in place of the built-in ones.
The patches of libraries below (not of the trainer) are separate functions, for processes and for
monkeypatch: slow_set_epoch, record_shares, slow_down_denoising, report_free_bytes.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import time

IN_A_PROCESS_OF_ITS_OWN = False  # set by __main__ below: a death then ends the process


class ProcessDied(BaseException):
    """The run died here (in the test process, where os._exit would end the tests)."""


def die() -> None:
    if IN_A_PROCESS_OF_ITS_OWN:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    raise ProcessDied


def chain(first, second):
    """Both hooks, in order (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda *args: (first(*args), second(*args))


def saving(step) -> callable:
    """Whether a folder given to before_checkpoint_marker is checkpoint `step` being completed."""
    return lambda directory: os.path.basename(directory) == f".checkpoint-{step}.tmp"


def hooks(stop_after_checkpoint=None, sigkill_in_save=None, nan_at_steps=(), signal_at_step=None,
          signal_name="SIGTERM", signal_ranks=None, signal_in_save=None, signal_in_setup=False, enospc_at=None,
          fill_disk_in_save=None,
          fill_disk_at=None, record_labels=None, step_seconds=None, dynamo_counts=None, data_source=None):
    """A training.hooks.Hooks with the faults and probes named (the module docstring says what each does)."""
    from diffusion_extras.training.hooks import Hooks
    made = Hooks(data_source=data_source)

    def add(name, function):
        setattr(made, name, chain(getattr(made, name), function))

    if stop_after_checkpoint is not None:
        add("after_checkpoint", lambda run, path: run.progress.global_step == int(stop_after_checkpoint) and die())
    if sigkill_in_save is not None:
        add("before_checkpoint_marker",
            lambda directory: saving(sigkill_in_save)(directory) and os.kill(os.getpid(), signal.SIGKILL))
    if signal_at_step is not None:
        def signal_self(run):
            rank = run.accelerator.process_index
            if run.progress.global_step == int(signal_at_step) and (signal_ranks is None or rank in signal_ranks):
                os.kill(os.getpid(), getattr(signal, signal_name))
        add("after_step", signal_self)
    if signal_in_save is not None:
        add("before_checkpoint_marker",
            lambda directory: saving(signal_in_save)(directory) and os.kill(os.getpid(), signal.SIGTERM))
    if signal_in_setup:
        made.data_source = signal_then(made.data_source)
    if enospc_at is not None:
        add_enospc(made, *enospc_at)
    if fill_disk_in_save is not None:
        step, path = fill_disk_in_save
        add("before_checkpoint_marker", lambda directory: saving(step)(directory) and fill_disk(path))
    if fill_disk_at is not None:
        what, step, path = fill_disk_at
        add("before_write", lambda run, name: name == what and run.progress.global_step >= int(step)
            and not os.path.exists(path) and fill_disk(path))
    if record_labels is not None:
        made.model_input = label_recorder(record_labels)
    if nan_at_steps:
        poisoned = {int(step) for step in nan_at_steps}

        def poison(run, clean, micro_step):
            optimizer_step = micro_step // run.config.gradient_accumulation_steps + 1
            return clean * float("nan") if optimizer_step in poisoned else clean
        made.model_input = poison
    if step_seconds is not None:
        add("after_step", slow_steps(float(step_seconds)))
    if dynamo_counts is not None:
        add("after_step", lambda run: write_dynamo_counts(dynamo_counts, run.progress.global_step))
    return made


def signal_then(data_source):
    """A data_source hook that sends the process SIGTERM, then builds `data_source` (None: the built-in)."""
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        from diffusion_extras.data.sources import build_source
        return (data_source or build_source)(*args, **kwargs)
    return signalled


def add_enospc(made, what: str, step) -> None:
    def full(path=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([path] if path else []))
    if what == "checkpoint":
        made.before_checkpoint_marker = chain(made.before_checkpoint_marker,
                                              lambda directory: saving(step)(directory) and full(directory))
    else:
        made.before_write = chain(made.before_write,
                                  lambda run, name: name == what and run.progress.global_step >= int(step) and full())


def slow_steps(seconds: float):
    first_step = []  # the step this run began with: 1 unless it resumed

    def slow_down(run):
        first_step[:] = first_step or [run.progress.global_step]
        if first_step == [1]:
            time.sleep(seconds)
    return slow_down


def label_recorder(path):
    """A model_input hook that notes the clean images of a micro-step, and a forward pre-hook on the
    UNet (registered at the first call) that writes them with the class labels of that forward."""
    pending, registered = {}, []

    def write_labels(module, args, kwargs):
        if pending:  # a training forward (sample grids and probes call the UNet without a pending batch)
            labels = kwargs.get("class_labels")
            with open(path, "a") as fh:
                fh.write(json.dumps({**pending, "labels": None if labels is None else labels.tolist()}) + "\n")
            pending.clear()

    def note_images(run, clean, micro_step):
        if not registered:
            registered.append(run.learner.unet.register_forward_pre_hook(write_labels, with_kwargs=True))
        pending.update(rank=run.accelerator.process_index, micro_step=micro_step,
                       means=clean.mean(dim=(1, 2, 3)).tolist())
        return clean
    return note_images


def dynamo_counts() -> dict:
    """torch.compile's tallies in this process so far (torch._dynamo.utils.counters): graphs
    captured, graph breaks, and frames compiled (a recompile compiles a frame again)."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "frames": counters["frames"]["total"]}


def write_dynamo_counts(folder: str, step) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as fh:
        fh.write(json.dumps({"step": step, **dynamo_counts()}) + "\n")


def fill_disk(path) -> None:
    """PATH grows until its file system is full (another writer taking the space)."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC


# ----------------------------------------------------------------------------- patches of libraries
def slow_set_epoch(seconds: float):
    """A stand-in for datasets' IterableDataset.set_epoch, which does `self._epoch += epoch - self._epoch`
    on a tensor in shared memory that all DataLoader workers of a process share: a read-modify-write.
    This one reads, waits `seconds`, then writes, so workers that set the epoch together race every
    time. Patched in before the workers fork, it holds in them."""
    def set_epoch_slowly(self, epoch):
        delta = epoch - self._epoch
        time.sleep(seconds)
        self._epoch += delta
    return set_epoch_slowly


def record_shares(folder: str, sample_features):
    """A wrapper of evaluation.metrics.sample_features (the images one rank samples for FID/KID) that
    appends {"firsts": its batches' first image indices, "images": how many} to DIR/rank<RANK>.jsonl."""
    def recording(*args, **kwargs):
        features = sample_features(*args, **kwargs)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as fh:
            fh.write(json.dumps({"firsts": sorted(features),
                                 "images": sum(len(value[0]) for value in features.values())}) + "\n")
        return features
    return recording


def read_shares(folder) -> dict:
    """{rank: [record_shares' records of that rank, in call order]} from `folder`."""
    shares = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as fh:
            shares[int(name[len("rank"):-len(".jsonl")])] = [json.loads(line) for line in fh]
    return shares


def slow_down_denoising(seconds: float, scheduler_step):
    """A wrapper of evaluation.sampling.scheduler_step (one denoising step of a batch) that waits first."""
    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return scheduler_step(*args, **kwargs)
    return slowed


def report_free_bytes(free_bytes: int, disk_usage):
    """A wrapper of shutil.disk_usage that reports `free_bytes` free: a small disk without filling one."""
    return lambda path: disk_usage(path)._replace(free=free_bytes)


# ----------------------------------------------------------------------------- as a process
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="python tests/faults.py [FAULTS] -- TRAINER_FLAGS")
    parser.add_argument("--command", choices=("train", "evaluate"), default="train",
                        help="the command run with the faults: train_ddpm.py or diffusion_extras.evaluate")
    parser.add_argument("--stop_after_checkpoint", type=int)
    parser.add_argument("--sigkill_in_save", type=int)
    parser.add_argument("--nan_at_steps", type=int, nargs="+", default=())
    parser.add_argument("--signal_at_step", type=int)
    parser.add_argument("--signal_name", default="SIGTERM")
    parser.add_argument("--signal_ranks", type=int, nargs="+")
    parser.add_argument("--signal_in_save", type=int)
    parser.add_argument("--enospc_at", nargs=2, metavar=("WHAT", "STEP"))
    parser.add_argument("--record_labels")
    parser.add_argument("--step_seconds", type=float)
    parser.add_argument("--dynamo_counts")
    parser.add_argument("--slow_set_epoch", type=float, help="datasets' set_epoch waits this long (a race)")
    parser.add_argument("--record_shares", help="a folder: each rank's FID/KID share is recorded there")
    parser.add_argument("--denoise_seconds", type=float, help="each denoising step of a grid or FID waits this long")
    parser.add_argument("--free_bytes", type=int, help="the disk reports this many free bytes")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])  # --help answers here
    if split == len(argv):
        parser.error("give the command's own flags after --")
    return args, argv[split + 1:]


def main(argv) -> int:
    args, command_argv = parse_args(argv)
    if args.slow_set_epoch is not None:
        import datasets
        datasets.IterableDataset.set_epoch = slow_set_epoch(args.slow_set_epoch)
    if args.record_shares:
        from diffusion_extras.evaluation import metrics
        metrics.sample_features = record_shares(args.record_shares, metrics.sample_features)
    if args.denoise_seconds is not None:
        from diffusion_extras.evaluation import sampling
        sampling.scheduler_step = slow_down_denoising(args.denoise_seconds, sampling.scheduler_step)
    if args.free_bytes is not None:
        import shutil
        shutil.disk_usage = report_free_bytes(args.free_bytes, shutil.disk_usage)
    if args.command == "evaluate":
        from diffusion_extras.cli.evaluate import main as evaluate
        return evaluate(command_argv)
    from diffusion_extras.training.main import main as train
    faults = {name: value for name, value in vars(args).items()
              if name not in ("command", "slow_set_epoch", "record_shares", "denoise_seconds", "free_bytes")}
    code = train(command_argv, hooks(**faults))
    if args.dynamo_counts:  # and once more after the end-of-run work (grids, evaluation, export)
        write_dynamo_counts(args.dynamo_counts, "end")
    return code


if __name__ == "__main__":
    IN_A_PROCESS_OF_ITS_OWN = True
    from diffusion_extras.core import stop_flag
    from diffusion_extras.training.main import finish
    stop_flag.record_early_signals()  # as train_ddpm.py does
    finish(main(sys.argv[1:]))
