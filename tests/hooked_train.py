"""The trainer with test-only failure injection through its extension points
(diffusion_extras.training.hooks), driven by environment variables:

DDPM_TEST_STOP_AFTER_STEP=N   the process dies (os._exit, no export) right after checkpoint N is saved:
                              a run cut off by pre-emption at a checkpoint boundary.
DDPM_TEST_SIGKILL_IN_SAVE=N   SIGKILL while checkpoint N is being completed (files written, no marker yet).
DDPM_TEST_NAN_AT_STEPS=a,b    the model inputs of those optimizer steps (1-based) are NaN.
DDPM_TEST_SLOW_SET_EPOCH=S    datasets' set_epoch waits S seconds between its read and its write of the
                              shared epoch (conftest.slow_set_epoch): DataLoader workers race on it.
                              (A patch of the datasets library in this test process, not of the trainer.)
DDPM_TEST_SIGNAL_AT_STEP=N[:SIG[:RANKS]]  after optimizer step N the process sends itself SIG (default
                              SIGTERM), on the ranks listed (comma-separated; default all): a preemption.
DDPM_TEST_SIGNAL_IN_SAVE=N    a SIGTERM while checkpoint N is being completed (a second signal during the save).
DDPM_TEST_ENOSPC_AT=WHAT:N    OSError(ENOSPC) at the first guarded write WHAT ("checkpoint", "pipeline export",
                              "sample grid", "log history") at or after step N; "checkpoint" fails
                              mid-save (files written, no marker yet).
DDPM_TEST_FILL_DISK_IN_SAVE=N:PATH  while checkpoint N is being completed, PATH grows until the disk is
                              full: the marker then meets a real ENOSPC (tests on a small tmpfs).
DDPM_TEST_FILL_DISK_AT=WHAT:N:PATH  at the first guarded write WHAT at or after step N, PATH grows until the
                              disk is full: that write then creates its files and meets a real ENOSPC.
DDPM_TEST_RECORD_LABELS=PATH  each training forward appends {"rank", "micro_step", "means": the clean images'
                              mean pixel in [-1, 1], "labels": the class labels the UNet is given} to PATH (JSON
                              lines): which label reached the model with which image. Not a fault.
DDPM_TEST_RECORD_SHARES=DIR   each call of evaluation.metrics.sample_features (the images one rank samples
                              for FID/KID) appends {"firsts": its batches' first image indices, "images":
                              how many} to DIR/rank<RANK>.jsonl (record_shares; a wrapper that passes
                              every call through). Not a fault.
DDPM_TEST_DYNAMO_COUNTS=DIR   after each optimizer step and at the end, this process's torch.compile tallies
                              (conftest.dynamo_counts) as a line of DIR/rank<i>.jsonl.
DDPM_TEST_STEP_SECONDS=S      in a run that starts from step 0, after each optimizer step the process sleeps
                              S seconds: it lasts until a scheduler stops it, on little CPU, as a slow job
                              does (test_slurm); its resumption is not slowed. Not a fault: the numbers
                              are those of an unslowed run.
DDPM_TEST_DENOISE_SECONDS=S   each unguided denoising step of evaluation.sampling (sample grids, FID images)
                              sleeps S seconds before the scheduler's step: the work between training steps
                              lasts long, on little CPU, for a signal to land in (test_preemption). Not a
                              fault: the images are those of an unslowed run.
"""
import errno
import json
import os
import signal
import sys
import time

from diffusion_extras.training.main import Hooks, finish, main


def hooks_from_environment(environ) -> Hooks:
    hooks = Hooks()
    stop_after = environ.get("DDPM_TEST_STOP_AFTER_STEP")
    kill_in_save = environ.get("DDPM_TEST_SIGKILL_IN_SAVE")
    nan_steps = environ.get("DDPM_TEST_NAN_AT_STEPS")
    if stop_after:
        def die_after(run, path):
            if run.progress.global_step == int(stop_after):
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(0)
        hooks.after_checkpoint = die_after
    if kill_in_save:
        def kill_before_marker(directory):
            if os.path.basename(directory) == f".checkpoint-{kill_in_save}.tmp":
                os.kill(os.getpid(), signal.SIGKILL)
        hooks.before_checkpoint_marker = kill_before_marker
    add_preemption_faults(hooks, environ)
    add_disk_faults(hooks, environ)
    if environ.get("DDPM_TEST_RECORD_LABELS"):
        hooks.model_input = label_recorder(environ["DDPM_TEST_RECORD_LABELS"])
    if nan_steps:
        poisoned = {int(step) for step in nan_steps.split(",")}

        def poison(run, clean, micro_step):
            optimizer_step = micro_step // run.config.gradient_accumulation_steps + 1
            return clean * float("nan") if optimizer_step in poisoned else clean
        hooks.model_input = poison
    step_seconds = environ.get("DDPM_TEST_STEP_SECONDS")
    if step_seconds:
        first_step = []  # the step this process began with: 1 unless it resumed

        def slow_down(run):
            first_step[:] = first_step or [run.progress.global_step]
            if first_step == [1]:
                time.sleep(float(step_seconds))
        hooks.after_step = chain(hooks.after_step, slow_down)
    counts_folder = environ.get("DDPM_TEST_DYNAMO_COUNTS")
    if counts_folder:
        hooks.after_step = chain(hooks.after_step, lambda run: write_dynamo_counts(counts_folder,
                                                                                   run.progress.global_step))
    return hooks


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


def write_dynamo_counts(folder: str, step) -> None:
    from conftest import dynamo_counts
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as fh:
        fh.write(json.dumps({"step": step, **dynamo_counts()}) + "\n")


def record_shares(folder: str) -> None:
    """Note what each call of metrics.sample_features returns on this rank (the call is unchanged)."""
    from diffusion_extras.evaluation import metrics
    sample_features = metrics.sample_features

    def recording(*args, **kwargs):
        features = sample_features(*args, **kwargs)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as fh:
            fh.write(json.dumps({"firsts": sorted(features),
                                 "images": sum(len(value[0]) for value in features.values())}) + "\n")
        return features
    metrics.sample_features = recording


def slow_down_denoising(seconds: float) -> None:
    """Each call of evaluation.sampling's scheduler_step (one denoising step of a batch) waits
    `seconds` first (a wrapper that passes every call through)."""
    from diffusion_extras.evaluation import sampling
    scheduler_step = sampling.scheduler_step

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return scheduler_step(*args, **kwargs)
    sampling.scheduler_step = slowed


def read_shares(folder) -> dict:
    """{rank: [record_shares' records of that rank, in call order]} from `folder`."""
    shares = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as fh:
            shares[int(name[len("rank"):-len(".jsonl")])] = [json.loads(line) for line in fh]
    return shares


def chain(first, second):
    """Both hooks, in order (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda *args: (first(*args), second(*args))


def in_save(step):
    return lambda directory: os.path.basename(directory) == f".checkpoint-{step}.tmp"


def add_preemption_faults(hooks: Hooks, environ) -> None:
    at_step, in_save_step = environ.get("DDPM_TEST_SIGNAL_AT_STEP"), environ.get("DDPM_TEST_SIGNAL_IN_SAVE")
    if at_step:
        parts = at_step.split(":")
        step, name, ranks = parts[0], (parts[1:2] or ["SIGTERM"])[0], (parts[2:3] or [""])[0]

        def signal_self(run):
            rank = run.accelerator.process_index
            if run.progress.global_step == int(step) and (not ranks or str(rank) in ranks.split(",")):
                os.kill(os.getpid(), getattr(signal, name))
        hooks.after_step = signal_self
    if in_save_step:
        saving = in_save(in_save_step)
        hooks.before_checkpoint_marker = chain(hooks.before_checkpoint_marker, lambda directory: saving(directory)
                                               and os.kill(os.getpid(), signal.SIGTERM))


def add_disk_faults(hooks: Hooks, environ) -> None:
    enospc_at, fill_in_save = environ.get("DDPM_TEST_ENOSPC_AT"), environ.get("DDPM_TEST_FILL_DISK_IN_SAVE")
    if enospc_at:
        what, step = enospc_at.split(":")
        if what == "checkpoint":
            saving = in_save(step)

            def fail_in_save(directory):
                if saving(directory):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)
            hooks.before_checkpoint_marker = chain(hooks.before_checkpoint_marker, fail_in_save)
        else:
            def fail_write(run, name):
                if name == what and run.progress.global_step >= int(step):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            hooks.before_write = fail_write
    if fill_in_save:
        step, path = fill_in_save.split(":", 1)
        saving = in_save(step)
        hooks.before_checkpoint_marker = chain(hooks.before_checkpoint_marker,
                                               lambda directory: saving(directory) and fill_disk(path))
    fill_at = environ.get("DDPM_TEST_FILL_DISK_AT")
    if fill_at:
        what, step, path = fill_at.split(":", 2)

        def fill_before_write(run, name):
            if name == what and run.progress.global_step >= int(step) and not os.path.exists(path):
                fill_disk(path)
        hooks.before_write = fill_before_write


def fill_disk(path) -> None:
    """PATH grows until its file system is full (another writer taking the space)."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC


def slow_down_set_epoch(environ) -> None:
    seconds = environ.get("DDPM_TEST_SLOW_SET_EPOCH")
    if seconds:
        import datasets
        from conftest import slow_set_epoch
        datasets.IterableDataset.set_epoch = slow_set_epoch(float(seconds))


if __name__ == "__main__":
    slow_down_set_epoch(os.environ)
    if os.environ.get("DDPM_TEST_RECORD_SHARES"):
        record_shares(os.environ["DDPM_TEST_RECORD_SHARES"])
    if os.environ.get("DDPM_TEST_DENOISE_SECONDS"):
        slow_down_denoising(float(os.environ["DDPM_TEST_DENOISE_SECONDS"]))
    status = main(hooks=hooks_from_environment(os.environ))
    if os.environ.get("DDPM_TEST_DYNAMO_COUNTS"):
        write_dynamo_counts(os.environ["DDPM_TEST_DYNAMO_COUNTS"], "end")
    finish(status)
