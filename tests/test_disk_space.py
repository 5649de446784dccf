"""A full disk (training/disk_space.py): the pre-check refuses a checkpoint that cannot fit, and an
ENOSPC that still happens (checkpoint, export, grid, history) removes the partial files; both
print one line naming the folder, the free and needed space and the newest checkpoint, and exit 5.
Freeing space and resuming as the line says gives the uninterrupted run's weights, bit for bit."""
import errno
import io
import os
import shutil
import subprocess

import faults
import pytest
import torch
from helpers import assert_same_state, load_unet_weights, run_training, write_tiny_recipe

STEPS = 6
RECIPE = dict(max_train_steps=STEPS, checkpointing_steps=2, save_images_steps=4, save_model_steps=4)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    recipe = write_tiny_recipe(folder, **RECIPE)
    run_training(recipe, folder / "run")
    return recipe, folder / "run"


def the_error_line(result) -> str:
    assert result.returncode == 5, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def leftovers(output_dir) -> list:
    return [name for name in os.listdir(output_dir) if name.endswith(".tmp")]


@pytest.mark.xdist_group("test_disk_space.straight")
@pytest.mark.parametrize("what, newest", [("checkpoint", 2), ("pipeline export", 4), ("sample grid", 4),
                                          ("log history", 2)])
def test_enospc_at_each_write_is_one_line_cleanup_and_resume(straight, tmp_path, what, newest):
    """The error line and the resume after an ENOSPC at each guarded write. The error is raised
    before that write starts (checkpoint: after its files, before the marker), so the cleanup of
    real partial files is asserted by test_real_full_disk_at_export_and_grid (a tmpfs, root) and
    test_a_failed_write_removes_the_partial_files_it_left (in-process, any user)."""
    recipe, reference = straight
    out = tmp_path / "run"
    result = run_training(recipe, out, hooks=faults.hooks(enospc_at=(what, 4)), check=False)
    line = the_error_line(result)
    name = "checkpoint-4" if what == "checkpoint" else what
    assert line.startswith(f"error: no space left on the device while writing the {name} in {out} (")
    assert f"newest complete checkpoint: {out / f'checkpoint-{newest}'}" in line
    assert line.endswith("then resume with --resume_from_checkpoint latest")
    assert leftovers(out) == []  # no .checkpoint-4.tmp, no .pipeline.tmp
    if what == "sample grid":
        assert not os.path.exists(out / "samples" / "step_000004.png")
    if what == "checkpoint":
        assert "removed the partial " + str(out / ".checkpoint-4.tmp") in line
    assert os.path.isdir(out / "checkpoint-2")  # nothing written before is lost
    run_training(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


@pytest.mark.xdist_group("test_disk_space.straight")
def test_precheck_refuses_with_the_numbers_then_resume_after_freeing(straight, tmp_path, monkeypatch):
    recipe, reference = straight
    out = tmp_path / "run"
    with pytest.raises(faults.ProcessDied):
        run_training(recipe, out, hooks=faults.hooks(stop_after_checkpoint=2))
    with monkeypatch.context() as small:  # the disk reports 1000 bytes free
        small.setattr(shutil, "disk_usage", faults.report_free_bytes(1000, shutil.disk_usage))
        result = run_training(recipe, out, "--resume_from_checkpoint", "latest", check=False)
    line = the_error_line(result)
    size = sum(os.path.getsize(out / "checkpoint-2" / f) for f in os.listdir(out / "checkpoint-2")
               if f != "checkpoint_complete.json")
    assert line == (f"error: not enough disk space for checkpoint-4 in {out}: 0.0 MB free, {size / 1e6:.1f} MB "
                    f"needed (the size of checkpoint-2); nothing was written. Newest complete checkpoint: "
                    f"{out / 'checkpoint-2'}. Free space in {out} (or move older checkpoints elsewhere), then "
                    "resume with --resume_from_checkpoint latest")
    assert leftovers(out) == [] and not os.path.exists(out / "checkpoint-4")
    run_training(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


@pytest.mark.xdist_group("test_disk_space.straight")
def test_precheck_before_the_first_checkpoint_estimates_and_says_run_again(straight, tmp_path, monkeypatch):
    recipe, reference = straight
    out = tmp_path / "run"
    with monkeypatch.context() as small:  # the disk reports 1000 bytes free
        small.setattr(shutil, "disk_usage", faults.report_free_bytes(1000, shutil.disk_usage))
        result = run_training(recipe, out, check=False)
    line = the_error_line(result)
    assert "(estimated from the parameters)" in line and "Newest complete checkpoint: none yet" in line
    assert line.endswith("then run the same command again (no checkpoint to resume from yet)")
    run_training(recipe, out)  # (logs/history.jsonl keeps the refused run's lines 1-2 before the new ones)
    wa, wb = load_unet_weights(reference), load_unet_weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MB tmpfs (needs root: skipped otherwise)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.xdist_group("test_disk_space.straight")
def test_real_full_disk_mid_save_then_free_and_resume(straight, small_disk):
    """The disk fills while checkpoint-4 is completed (another writer takes the space): the marker
    meets a real ENOSPC. Deleting that writer's file and resuming finishes the run exactly."""
    recipe, reference = straight
    out, filler = small_disk / "run", small_disk / "filler"
    result = run_training(recipe, out, hooks=faults.hooks(fill_disk_in_save=(4, filler)), check=False)
    line = the_error_line(result)
    assert line.startswith(f"error: no space left on the device while writing the checkpoint-4 in {out} (")
    assert f"removed the partial {out / '.checkpoint-4.tmp'}" in line
    assert f"newest complete checkpoint: {out / 'checkpoint-2'}" in line
    assert leftovers(out) == [] and os.path.isdir(out / "checkpoint-2") and not os.path.exists(out / "checkpoint-4")
    os.remove(filler)
    run_training(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


@pytest.mark.xdist_group("test_disk_space.straight")
@pytest.mark.parametrize("what, partial", [("pipeline export", ".pipeline.tmp"),
                                           ("sample grid", "samples/step_000004")])
def test_real_full_disk_at_export_and_grid_removes_what_the_write_created(straight, small_disk, what, partial):
    """The disk fills just before the export / the grid of step 4 (another writer takes the space): the
    write creates its files and meets a real ENOSPC. The line names the partial files it removed
    (so they existed), none is left, and resuming after freeing the space finishes the run exactly."""
    recipe, reference = straight
    out, filler = small_disk / "run", small_disk / "filler"
    result = run_training(recipe, out, hooks=faults.hooks(fill_disk_at=(what, 4, filler)), check=False)
    line = the_error_line(result)
    assert line.startswith(f"error: no space left on the device while writing the {what} in {out} (")
    assert f"; removed the partial {out / partial}" in line, line
    assert f"newest complete checkpoint: {out / 'checkpoint-4'}" in line
    removed = line.split("; removed the partial ", 1)[1].split(". Everything written before", 1)[0].split(", ")
    assert leftovers(out) == [] and not any(os.path.exists(path) for path in removed), line
    os.remove(filler)
    run_training(recipe, out, "--resume_from_checkpoint", "latest")
    assert_same_state(reference, out, STEPS)


def write_bytes(path, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(b"\0" * size)


@pytest.mark.parametrize("what", ["pipeline export", "sample grid", "debug images"])
def test_a_failed_write_removes_the_partial_files_it_left(tmp_path, what):
    """disk_space.guarded_write with the partial paths the trainer gives it (training/periodic.py):
    the write leaves real files, then meets ENOSPC; they are removed and named, nothing else is."""
    from diffusion_extras.training import artifacts, models
    from diffusion_extras.training.disk_space import guarded_write
    from diffusion_extras.training.stops import DiskFull
    out = str(tmp_path)
    partial = {"pipeline export": [os.path.join(out, models.EXPORT_STAGING)],
               "sample grid": [artifacts.sample_grid_path(out, 4)],
               "debug images": artifacts.debug_image_paths(out, 4)}[what]
    written = [os.path.join(partial[0], "unet", "weights")] if what == "pipeline export" else partial[:2]
    os.makedirs(tmp_path / "logs")
    (tmp_path / "logs" / "kept").write_text("older")
    with pytest.raises(DiskFull) as stopped:
        with guarded_write(what, out, partial):
            for path in written[:-1]:
                write_bytes(path, 100)
            write_bytes(written[-1], 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), written[-1])  # the next write meets a full disk
    assert all(not os.path.exists(path) for path in partial)
    removed = [path for path in partial if any(w.startswith(path) for w in written)]
    assert f"; removed the partial {', '.join(removed)}." in str(stopped.value)
    assert (tmp_path / "logs" / "kept").read_text() == "older"


def test_history_append_that_meets_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch):
    """History.append writes part of its line, then the disk is full: the file is as before, so a
    resume reads every line. (A write that stops short, then fails: what a full file system does.)"""
    from diffusion_extras.training import tracking
    history = tracking.History(str(tmp_path))
    history.append({"step": 1, "loss": 0.5})
    before = open(history.path, "rb").read()
    real_open = open

    class FillsUp(io.FileIO):
        def write(self, data):
            if len(data) > 20:
                return super().write(bytes(data)[:20])  # a short write: part of the line is on disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tracking, "open", lambda path, mode, buffering=-1: FillsUp(path, "a"), raising=False)
    with pytest.raises(OSError):
        history.append({"step": 2, "loss": 0.25, "note": "x" * 100})
    monkeypatch.setattr(tracking, "open", real_open, raising=False)
    assert open(history.path, "rb").read() == before and history.read() == [{"step": 1, "loss": 0.5}]
