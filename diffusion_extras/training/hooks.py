"""The trainer's extension points: what a caller may replace without touching the trainer.

    from diffusion_extras.training.main import Hooks, main
    main(["--config", "recipe.yaml"], Hooks(data_source=MySource))

Each field's default is what `train_ddpm.py` does (None: the built-in, or nothing). Tests use them
to inject a third kind of data source (tests/test_sources.py's CountingSource) and faults
(tests/faults.py: a run that dies after checkpoint N, a SIGKILL inside the atomic save, NaN inputs
at chosen steps, a SIGTERM after step N, a full disk at a chosen write).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # main.py exports Hooks, and main.py imports without torch (tests/test_first_contact.py)
    import torch

    from diffusion_extras.training.run_state import Run


@dataclass
class Hooks:
    # (DataSpec, Processes (the accelerator), channels, dataset (with --streaming: the stream's first stored
    # images), validation_split, classes (data.labels.Classes with --class_conditional, else None)) -> an
    # object with the data-source interface of data/sources.py (batches, position, state_dict,
    # load_state_dict, reference_sample, held_out_images, batches_per_epoch, description, class_names);
    # None: data.sources.build_source (the decode-once cache or a stream)
    data_source: Callable | None = None
    # (run, checkpoint path): on every rank, after a checkpoint is complete (marker written)
    after_checkpoint: Callable[[Run, str], None] | None = None
    # (temporary checkpoint folder): inside the atomic save, after every file is written and
    # synced, before the completion marker: the moment a kill leaves a torn checkpoint
    before_checkpoint_marker: Callable[[str], None] | None = None
    # (run, clean model input in [-1, 1], micro-step) -> the model input: after decoding and
    # flips, before noising
    model_input: Callable[[Run, torch.Tensor, int], torch.Tensor] | None = None
    # (run): on every rank after each optimizer step, before the loop asks whether a stop signal
    # came (tests send SIGTERM to themselves here: a preemption at a chosen step)
    after_step: Callable[[Run], None] | None = None
    # (run, what: "checkpoint-N", "pipeline export", "sample grid", "log history"): at the start of
    # each guarded write of the output folder (training.disk_space); tests raise OSError(ENOSPC) here
    before_write: Callable[[Run, str], None] | None = None


def hook(run: Run, name: str) -> Callable | None:
    """The extension point `name` of run.hooks, or None when the run has no hooks or leaves it unset."""
    return getattr(run.hooks, name) if run.hooks is not None else None
