"""Conditioning on images, exactly: the random masks and condition drops are functions of (seed,
micro-step, image), so a stopped and resumed run ends bit for bit where a straight one does, and
2 ranks train as 1 rank of their global batch; cached and streamed."""
import json

import faults
import numpy as np
import pytest
from helpers import (
    assert_same_state,
    load_unet_weights,
    paired_images,
    read_history,
    run_training,
    write_paired_parquet,
)
from processes import launch_training

CPU = {"ACCELERATE_USE_CPU": "1"}
MASKS = ("--conditioning", "inpainting", "--conditioning_dropout_prob", 0.3, "--random_flip")  # streamed


def stop_and_resume(recipe, folder, *flags):
    """A run of `flags` stopped by a signal after step 3 (a checkpoint there), resumed to its end."""
    stopped = run_training(recipe, folder, *flags, hooks=faults.hooks(signal_at_step=3), check=False)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    run_training(recipe, folder, *flags, "--resume_from_checkpoint", "latest")


def kind_flags(kind: str, folder) -> tuple:
    """The flags of a run of `kind` with condition drops and flips: random masks or 2x
    super-resolution on the digits, or image-to-image on 32 pairs in a parquet column."""
    if kind == "image":
        images, pairs = paired_images(32, 8, 8, seed=5)
        data = write_paired_parquet(folder / "pairs.parquet", images, pairs, "edges")
        return ("--train_data_files", data, "--conditioning", "image", "--conditioning_image_column", "edges",
                "--conditioning_dropout_prob", 0.3, "--random_flip")
    return ("--conditioning", kind, *(("--sr_factor", 2) if kind == "super_resolution" else ()),
            "--conditioning_dropout_prob", 0.3, "--random_flip")


@pytest.mark.parametrize("kind, objective", [("inpainting", "ddpm"), ("super_resolution", "ddpm"), ("image", "ddpm"),
                                             ("super_resolution", "flow_matching"), ("image", "flow_matching")])
def test_a_resumed_run_of_each_kind_is_bit_exact(tiny_recipe, tmp_path, kind, objective):
    """32 images, 4 micro-batches an epoch, random masks, drops and flips: stopped after step 3,
    resumed to 6 (an epoch boundary crossed), against a straight run to 6. Under flow matching too
    (inpainting's flow export: test_flow_matching), whose export then steps with the flow's Euler."""
    recipe = tiny_recipe(checkpointing_steps=3, max_train_samples=32)
    flags = (*kind_flags(kind, tmp_path), "--objective", objective, "--max_train_steps", 6)
    run_training(recipe, tmp_path / "straight", *flags)
    stop_and_resume(recipe, tmp_path / "resumed", *flags)
    assert_same_state(tmp_path / "straight", tmp_path / "resumed", 6)
    scheduler = json.loads((tmp_path / "straight" / "scheduler" / "scheduler_config.json").read_text())["_class_name"]
    assert scheduler == {"ddpm": "DDPMScheduler", "flow_matching": "FlowMatchEulerDiscreteScheduler"}[objective]


def test_a_resumed_streamed_inpainting_run_is_bit_exact(tiny_recipe, tmp_path):
    """24 images in 4 parquet shards, streamed by 2 loader workers, random masks and drops: stopped
    after step 3 and resumed to 6 (past the stream's epoch), it ends where a straight run does."""
    images, masks = paired_images(24, 8, 8, seed=2)
    (tmp_path / "pq").mkdir()
    for shard in range(4):
        write_paired_parquet(tmp_path / "pq" / f"part-{shard}.parquet", images[shard::4], masks[shard::4], "other")
    recipe = tiny_recipe(checkpointing_steps=3, max_train_samples=None)
    flags = ("--dataset_name", tmp_path / "pq", "--streaming", "--dataloader_num_workers", 2, *MASKS,
             "--max_train_steps", 6)
    run_training(recipe, tmp_path / "straight", *flags)
    stop_and_resume(recipe, tmp_path / "resumed", *flags)
    assert_same_state(tmp_path / "straight", tmp_path / "resumed", 6)


def assert_trained_alike(two, one):
    w2, w1 = load_unet_weights(two), load_unet_weights(one)
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    assert ([row["loss"] for row in read_history(two)]
            == pytest.approx([row["loss"] for row in read_history(one)], rel=1e-5))


@pytest.mark.parametrize("kind", ["inpainting", "super_resolution"])
def test_two_ranks_equal_one_rank_of_the_same_global_batch(tiny_recipe, tmp_path, kind):
    """Random masks, drops and flips: 2 gloo ranks x 4 images draw, image by image, what 1 rank x 8 does."""
    flags = (*kind_flags(kind, tmp_path), "--max_train_steps", 4)
    two = launch_training(tiny_recipe(train_batch_size=4), tmp_path / "two", *flags, ranks=2, env=CPU)
    assert "replicas identical on 2 processes" in two.stdout
    run_training(tiny_recipe(train_batch_size=8), tmp_path / "one", *flags)
    assert_trained_alike(tmp_path / "two", tmp_path / "one")


def test_two_streaming_ranks_of_image_pairs_equal_one(tiny_recipe, tmp_path):
    """Image-to-image pairs in a column of 4 unshuffled parquet shards of 4: rank r of 2 reads shards
    r and r + 2, so 2 ranks x 4 pairs hold, step by step, what 1 rank x 8 reads from the shards in
    turn, with their conditions and flips."""
    images, pairs = paired_images(16, 8, 8, seed=3)
    (tmp_path / "pq").mkdir()
    for shard in range(4):
        write_paired_parquet(tmp_path / "pq" / f"part-{shard}.parquet", images[4 * shard:4 * shard + 4],
                             pairs[4 * shard:4 * shard + 4], "edges")
    flags = ("--dataset_name", tmp_path / "pq", "--streaming", "--shuffle_buffer_size", 0, "--random_flip",
             "--conditioning", "image", "--conditioning_image_column", "edges", "--max_train_steps", 4)
    two = launch_training(tiny_recipe(train_batch_size=4, max_train_samples=None), tmp_path / "two", *flags,
                          ranks=2, env=CPU)
    assert "replicas identical on 2 processes" in two.stdout
    run_training(tiny_recipe(train_batch_size=8, max_train_samples=None), tmp_path / "one", *flags)
    assert_trained_alike(tmp_path / "two", tmp_path / "one")
    assert np.isfinite([row["loss"] for row in read_history(tmp_path / "one")]).all()
