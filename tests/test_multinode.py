"""The decode cache at scale: built once per node, published race-free, guarded against a full
disk (a disk that reports little free space, in this process); two nodes on one machine (two
torch.distributed.run launches, processes) train, checkpoint, resume."""
import os
import socket
import subprocess
import sys

import faults
import numpy as np
import pytest
from helpers import ROOT, run_training, write_tar_shards
from processes import cli_env

from diffusion_extras.data import decode_cache
from diffusion_extras.data import images as data


def test_cache_race_loser_uses_the_winners_cache(tmp_path):
    directory = str(tmp_path / "ddpm_decoded" / "key")
    winner = [np.full((4, 4, 1), 7, np.uint8)]
    decode_cache.write_cache(directory, iter(winner))
    decode_cache.write_cache(directory, iter([np.full((4, 4, 1), 9, np.uint8)]))  # lost the race: discarded
    assert os.listdir(tmp_path / "ddpm_decoded") == ["key"]  # no tmp folder left behind
    assert (decode_cache.DecodedImages.load(directory, 1).image(0) == 7).all()


def test_disk_guard_message_names_streaming(tmp_path, monkeypatch):
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10_000))
    decode_cache.check_cache_space(str(tmp_path), 50, 8, 3)  # 9,600 bytes fit
    with pytest.raises(data.DataError, match="--streaming"):
        decode_cache.check_cache_space(str(tmp_path), 100, 8, 3)  # 19,200 bytes do not


def test_cli_refuses_a_cache_that_does_not_fit_and_streams_instead(tiny_recipe, tmp_path, monkeypatch):
    import shutil
    folder = write_tar_shards(tmp_path / "shards", shards=2, per_shard=8)
    recipe = tiny_recipe(train_batch_size=4, max_train_samples=None)
    flags = ["--train_data_files", f"{folder}/train-*.tar", "--max_train_steps", 2]
    # the disk reports 500 free bytes (shutil.disk_usage patched; the trainer untouched): 16 images of
    # 8x8x1 = 1,024 bytes do not fit
    monkeypatch.setattr(shutil, "disk_usage", faults.report_free_bytes(500, shutil.disk_usage))
    result = run_training(recipe, tmp_path / "cached", *flags, check=False)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the decoded-image cache needs") and "--streaming" in line
    assert not os.path.exists(tmp_path / "cached" / "checkpoint-2")
    run_training(recipe, tmp_path / "streamed", *flags, "--streaming")
    assert os.path.isfile(tmp_path / "streamed" / "unet" / "diffusion_pytorch_model.safetensors")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_nodes(tmp_path, output_dir, *flags):
    """Two torch.distributed.run launches (--nnodes 2, one process each) at once, as two machines
    would: each node has its own datasets cache (HF_DATASETS_CACHE, where the decode cache lives);
    the output dir is shared. Returns each node's (returncode, stdout + stderr)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**cli_env(), "ACCELERATE_USE_CPU": "1", "HF_DATASETS_CACHE": str(tmp_path / f"node{node}")}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "train_ddpm.py", "--output_dir", str(output_dir), *map(str, flags)]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        results.append((proc.returncode, out))
    for code, out in results:
        assert code == 0, out[-3000:]
    return [out for _, out in results]


def test_two_nodes_decode_once_each_train_checkpoint_and_resume(tiny_recipe, tmp_path):
    folder = write_tar_shards(tmp_path / "shards", shards=2, per_shard=8)
    recipe = tiny_recipe(train_batch_size=4, checkpointing_steps=2, max_train_samples=None)
    flags = ["--config", recipe, "--train_data_files", f"{folder}/train-*.tar"]
    first = launch_two_nodes(tmp_path, tmp_path / "run", *flags, "--max_train_steps", 2)
    assert [out.count("decoded 16 images once (uint8 samples) into") for out in first] == [1, 1]
    second = launch_two_nodes(tmp_path, tmp_path / "run", *flags, "--max_train_steps", 4,
                              "--resume_from_checkpoint", "latest")
    # each node reuses its cache
    assert [out.count("decoded 16 images once (uint8 samples) into") for out in second] == [0, 0]
    assert "resumed from" in second[0] and "step 2" in second[0]
    assert os.path.isdir(tmp_path / "run" / "checkpoint-4")
    for node in (0, 1):
        assert len(os.listdir(tmp_path / f"node{node}" / "ddpm_decoded")) == 1  # one cache, no tmp left
