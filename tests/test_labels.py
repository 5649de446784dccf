"""Class labels (diffusion_extras/data/labels.py): the label column found as webdataset tar shards keep
it (`cls`, or a `json` entry's `label`), read once for cached data and with each example from a
stream (workers, shuffle buffer, saved position), and through the command line: the label that
reaches the UNet is its image's, and a streamed conditional run resumes bit-exactly."""
import json
import os

import datasets
import faults
import pytest
from helpers import assert_same_state, read_history, run_training, write_tar_shards, write_tiny_recipe

from diffusion_extras.data import images as data
from diffusion_extras.data import labels, streaming
from diffusion_extras.data.images import DataError
from diffusion_extras.training.config import TrainConfig

GREY_STEP = 7  # image i has grey value 7*i (PNG: exact), so its id is read back from any crop
NAMES = ["cat", "dog", "fox"]
ENTRIES = {  # how a tar shard sample carries its class: image i is of class i % 3
    "cls": lambda i: {"cls": str(i % 3)},
    "json": lambda i: {"json": json.dumps({"label": NAMES[i % 3], "caption": f"image {i}"})},
}


def shards(folder, kind, count=8, per_shard=4):
    return write_tar_shards(folder, shards=count, per_shard=per_shard, extension="png", grey_step=GREY_STEP,
                            entries=ENTRIES[kind])


def image_id(mean_pixel: float) -> int:
    """The id of a constant image from its mean pixel value in [0, 255]."""
    return int(round(mean_pixel / GREY_STEP))


@pytest.mark.parametrize("kind, column, names", [("cls", "cls", ["0", "1", "2"]), ("json", "json.label", NAMES)])
def test_tar_shard_labels_are_found_and_read_once_for_cached_data(tmp_path, kind, column, names):
    dataset = data.load_image_dataset(TrainConfig(train_data_files=f"{shards(tmp_path / 's', kind, 2)}/*.tar",
                                                  cache_dir=str(tmp_path / "cache")))
    classes = labels.read_classes(dataset, None)
    assert (classes.column, classes.names) == (column, names)
    image_ids = [int(key) for key in dataset["__key__"]]
    assert classes.row_labels.tolist() == [i % 3 for i in image_ids]
    assert labels.read_classes(dataset, column).names == names  # named explicitly: the same
    with pytest.raises(DataError, match=r"--label_column json.kind is not in the dataset \(columns: png, "):
        labels.read_classes(dataset, "json.kind")


@pytest.mark.parametrize("kind, workers", [("cls", 2), ("json", 0)])
def test_streamed_labels_travel_with_their_images_and_their_saved_position(tmp_path, kind, workers):
    config = TrainConfig(train_data_files=f"{shards(tmp_path / 's', kind)}/*.tar", streaming=True,
                         shuffle_buffer_size=8, resolution=8, class_conditional=True)
    classes = streaming.read_stream_classes(config.data_spec())
    assert classes.row_labels is None and len(classes.names) == 3

    def batches():
        stream, column = streaming.load_stream(config.data_spec(), 0, 1, classes.column)
        return streaming.StreamingBatches(stream, column, 4, 8, True, 1, seed=0, num_workers=workers,
                                          label=classes.reader())

    def pairs(source, count):
        out = []
        for images, batch_labels in (next(source) for _ in range(count)):
            out += [(image_id(float(image.float().mean())), int(label)) for image, label in zip(images, batch_labels)]
        return out

    first = batches()
    seen = pairs(first, 3)
    state = first.state_dict()
    later = pairs(first, 7)  # through the end of the first epoch (8 batches) into the second
    assert all(label == image % 3 for image, label in seen + later)
    assert sorted(image for image, _ in (seen + later)[:32]) == list(range(32))  # each image once an epoch
    restored = batches()
    restored.load_state_dict(state)
    assert pairs(restored, 7) == later


def test_a_classlabel_stream_is_not_read_ahead_and_a_bad_label_is_named(tmp_path, monkeypatch):
    features = datasets.Features({"label": datasets.ClassLabel(names=["a", "b"])})
    stream = datasets.Dataset.from_dict({"label": [0, 1]}, features=features).to_iterable_dataset()
    monkeypatch.setattr(datasets.IterableDataset, "__iter__", lambda self: pytest.fail("read ahead"))
    classes = labels.stream_classes(stream, None)
    assert (classes.names, classes.column) == (["a", "b"], "label")
    with pytest.raises(DataError, match=r"--label_column label: label 2 is outside the declared classes 0..1"):
        classes.reader()({"label": 2})
    with pytest.raises(DataError, match="class 'emu' is not among the 3 read before training"):
        labels.LabelReader("json.label", NAMES, by_name=True)({"json": {"label": "emu"}})


# ----------------------------------------------------------------------------- the command line
def recorded_pairs(path, num_classes):
    """(image id, label the UNet saw) of every recorded training image, and how many were dropped."""
    pairs, dropped = [], 0
    with open(path) as fh:
        for line in fh:
            record = json.loads(line)
            for mean, label in zip(record["means"], record["labels"]):
                if label == num_classes:  # "no class": --condition_dropout
                    dropped += 1
                else:
                    pairs.append((image_id((mean + 1.0) * 127.5), label))
    return pairs, dropped


@pytest.fixture(scope="module")
def streamed_runs(tmp_path_factory):
    """Conditional runs streamed from tar shards (8 shards of 4, 8 batches an epoch): `cls` labels
    with 2 workers and a shuffle buffer, 10 steps straight and killed after checkpoint 5 and resumed;
    `json` labels (class names), 3 steps with no worker. The straight runs record what the UNet saw
    (faults' record_labels). All in this process; the loader workers are its children."""
    folder = tmp_path_factory.mktemp("streamed_labels")
    recipe = write_tiny_recipe(folder, train_batch_size=4, checkpointing_steps=5, max_train_samples=None,
                               condition_dropout=0.25)
    runs = {}
    for kind, workers, steps in (("cls", 2, 10), ("json", 0, 3)):
        shards(folder / kind, kind)
        runs[kind], runs[f"{kind}-labels"] = folder / f"{kind}-straight", folder / f"{kind}.jsonl"
        run_training(recipe, runs[kind], *flags_of(folder, kind, workers, steps),
                     hooks=faults.hooks(record_labels=runs[f"{kind}-labels"]))
    resumed, flags = folder / "cls-resumed", flags_of(folder, "cls", 2, 10)
    with pytest.raises(faults.ProcessDied):
        run_training(recipe, resumed, *flags, hooks=faults.hooks(stop_after_checkpoint=5))
    run_training(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    runs["cls-resumed"] = resumed
    return runs


def flags_of(folder, kind, workers, steps):
    """The command line of a conditional run streamed from the shards in folder/kind."""
    return ["--train_data_files", f"{folder / kind}/*.tar", "--streaming", "--class_conditional",
            "--shuffle_buffer_size", 8, "--dataloader_num_workers", workers, "--max_train_steps", steps]


@pytest.mark.xdist_group("test_labels.streamed_runs")
@pytest.mark.parametrize("kind, names", [("cls", ["0", "1", "2"]), ("json", NAMES)])
def test_streamed_tar_shard_labels_reach_the_unet_with_their_images(streamed_runs, kind, names):
    pairs, dropped = recorded_pairs(streamed_runs[f"{kind}-labels"], len(names))
    steps = {"cls": 10, "json": 3}[kind]
    assert len(pairs) + dropped == 4 * steps and dropped > 0  # 4 images a step; some labels dropped to "no class"
    assert all(label == image % 3 for image, label in pairs), pairs
    assert {label for _, label in pairs} == {0, 1, 2}
    with open(os.path.join(streamed_runs[kind], "model_index.json")) as fh:
        assert json.load(fh)["id2label"] == {str(i): name for i, name in enumerate(names)}
    logged = {key for record in read_history(streamed_runs[kind]) for key in record if key.startswith("loss_class/")}
    assert logged == {"loss_class/00", "loss_class/01", "loss_class/02"}  # the diagnostics' loss per class


@pytest.mark.xdist_group("test_labels.streamed_runs")
def test_a_streamed_conditional_run_resumes_bit_exactly(streamed_runs):
    assert_same_state(streamed_runs["cls"], streamed_runs["cls-resumed"], 10)


def write_labelled_parquet(path, labels_of_rows):
    """A parquet file of constant 8 px RGB images (grey 4*i) whose `label` column is a ClassLabel
    (classes a, b) kept in the file's schema, so a stream declares its classes and reads none ahead."""
    import numpy as np
    from PIL import Image
    images = [Image.fromarray(np.full((8, 8, 3), 4 * i, np.uint8)) for i in range(len(labels_of_rows))]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"image": images, "label": labels_of_rows}, features=features).to_parquet(str(path))
    return str(path)


def test_a_streamed_label_outside_the_classes_is_one_line_and_the_run_resumes_once_fixed(tmp_path):
    """A ClassLabel stream is not read ahead, so a label outside its classes (-1 in row 41 of 64,
    read a few steps in with a shuffle buffer of 4) is met by a loader worker while training: one
    line naming it and the checkpoint to resume from, exit code 2; with the row fixed, the run
    resumes from that checkpoint and ends."""
    labelled = [i % 2 for i in range(64)]
    data_file = write_labelled_parquet(tmp_path / "train.parquet", labelled[:41] + [-1] + labelled[42:])
    recipe = write_tiny_recipe(tmp_path, train_batch_size=4, checkpointing_steps=2, max_train_samples=None)
    out = tmp_path / "run"
    flags = ["--train_data_files", data_file, "--streaming", "--class_conditional", "--shuffle_buffer_size", 4,
             "--dataloader_num_workers", 1, "--max_train_steps", 14]
    failed = run_training(recipe, out, *flags, check=False)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    saved = sorted(int(name.split("-")[1]) for name in os.listdir(out) if name.startswith("checkpoint-"))
    assert saved and saved[-1] < 14 and not os.path.exists(out / "unet")  # stopped part-way, not exported
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --label_column label: label -1 is outside the declared classes 0..1 (met while "
                      f"training). Newest complete checkpoint: {out / f'checkpoint-{saved[-1]}'}. Fix the data, "
                      "then resume with --resume_from_checkpoint latest"], failed.stderr[-3000:]
    write_labelled_parquet(tmp_path / "train.parquet", labelled)
    run_training(recipe, out, *flags, "--resume_from_checkpoint", "latest")
    assert os.path.exists(out / "checkpoint-14") and os.path.exists(out / "model_index.json")
    assert [h["step"] for h in read_history(out)][-1] == 14
