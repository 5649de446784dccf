"""The data-source interface (diffusion_extras/data/sources.py): the loop, resume, checkpoints and the
artifacts use only it, so a third kind of source trains, checkpoints and resumes unchanged."""
import glob
import json
import os
import re

import faults
import numpy as np
import torch
from helpers import ROOT, run_training

from diffusion_extras.data.sources import CachedImages
from diffusion_extras.training.config import TrainConfig


class CountingSource:
    """A third kind of data source, given through the `data_source` extension point
    (diffusion_extras.training.hooks): images whose value is the micro-step, a position counted in
    batches served. If the loop, checkpoints, resume and artifacts use only the data-source
    interface, it trains."""
    batches_per_epoch = 5
    description = "counting"
    held_out_images = None

    def __init__(self, spec, processes, channels, dataset=None, validation_split=0.0, classes=None):
        self.spec, self.channels, self.served = spec, channels, 0

    def _batch(self, micro_step):
        value = micro_step % 255
        shape = (self.spec.train_batch_size, self.channels, self.spec.resolution, self.spec.resolution)
        return torch.full(shape, value, dtype=torch.uint8)

    def batches(self, first, last):
        print(f"counting source: batches from {first} to {last}, served so far {self.served}", flush=True)
        for micro_step in range(first, last):
            self.served += 1
            yield self._batch(micro_step)

    def position(self, micro_step):
        return {"epoch": micro_step // 5, "batch_in_epoch": micro_step % 5}

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.served = state["served"]

    def reference_sample(self, count):
        return np.stack([self._batch(k)[0].numpy() for k in range(min(count, 8))])


class OneProcess:
    process_index, num_processes, is_local_main_process = 0, 1, True
    device = torch.device("cpu")

    def local_main_process_first(self):
        import contextlib
        return contextlib.nullcontext()


def test_cached_source_serves_the_seeded_order_from_any_micro_step():
    config = TrainConfig(max_train_samples=40, resolution=8, train_batch_size=4)
    source = CachedImages(config, OneProcess(), 1)
    assert source.batches_per_epoch == 10
    straight = list(source.batches(0, 12))
    resumed = list(source.batches(7, 12))
    assert all(torch.equal(a, b) for a, b in zip(straight[7:], resumed))
    assert source.position(12) == {"epoch": 1, "batch_in_epoch": 2}
    assert source.state_dict() is None  # the micro-step is the whole position
    sample = source.reference_sample(16)
    assert sample.shape == (16, 1, 8, 8) and sample.dtype == np.uint8


def test_loop_and_artifacts_do_not_branch_on_the_kind_of_source():
    # every module of the trainer but the declarations (run_state names the two source types, config the flags)
    trainer = [path for path in glob.glob(os.path.join(ROOT, "diffusion_extras", "training", "*.py"))
               if os.path.basename(path) not in ("run_state.py", "config.py")]
    assert len(trainer) > 5, trainer
    for name in trainer:
        with open(name) as fh:
            text = fh.read()
        assert not re.search(r"run\.(stream|images|order)\b|streaming\.", text), name


def test_a_third_source_trains_checkpoints_and_resumes(tiny_recipe, tmp_path):
    recipe = tiny_recipe(checkpointing_steps=2, eval_steps=4, feature_extractor="tiny", eval_num_samples=4)
    first = run_training(recipe, tmp_path / "run", "--max_train_steps", 2,
                         hooks=faults.hooks(data_source=CountingSource))
    assert "batches from 0 to 2, served so far 0" in first.stdout
    with open(tmp_path / "run" / "checkpoint-2" / "rank_state_0.json") as fh:
        assert json.load(fh) == {"served": 2}
    with open(tmp_path / "run" / "checkpoint-2" / "train_state.json") as fh:
        assert {"epoch": 0, "batch_in_epoch": 2}.items() <= json.load(fh).items()
    second = run_training(recipe, tmp_path / "run", "--max_train_steps", 4, "--resume_from_checkpoint", "latest",
                          hooks=faults.hooks(data_source=CountingSource))
    assert "batches from 2 to 4, served so far 2" in second.stdout  # the restored state reached the source
    assert os.path.isdir(tmp_path / "run" / "checkpoint-4")
