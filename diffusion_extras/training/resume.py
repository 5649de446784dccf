"""Resume: load the newest usable checkpoint, apply the changed settings whose policy is apply,
set aside the checkpoints of an abandoned future."""
from __future__ import annotations

import warnings

from diffusion_extras.training import autoencoder, checkpointing, resume_policy
from diffusion_extras.training.run_state import Run


def resume(run: Run) -> None:
    """Load the newest usable checkpoint, apply the changed settings whose policy is apply (each
    named in one line), and set aside the checkpoints of an abandoned future (a rollback)."""
    config, accelerator, learner, progress = run.config, run.accelerator, run.learner, run.progress
    candidates = checkpointing.resume_candidates(config.output_dir, config.resume_from_checkpoint)
    if not candidates:
        accelerator.print(f"no checkpoint in {config.output_dir}: starting a fresh run")
        return
    notes = []  # what reconcile recognised in the last checkpoint checked

    def reconcile(saved: dict) -> dict:  # a VAE fingerprint of an earlier release's form
        saved, note = autoencoder.reconcile_vae_record(saved, learner.state_config, run.data.vae_earlier)
        notes[:] = [note] if note else []
        return saved
    for path in candidates:
        state, applied = checkpointing.check_resumable(path, learner.state_config, reconcile)
        try:
            checkpointing.load_state(accelerator, path)
        except Exception as error:  # unreadable despite a complete marker: fall back, as with truncation
            if config.resume_from_checkpoint != "latest" or path == candidates[-1]:
                raise checkpointing.CheckpointError(f"cannot load {path}: {type(error).__name__}: {error}") from None
            warnings.warn(f"cannot load {path} ({type(error).__name__}: {error}); falling back to the previous one",
                          stacklevel=2)
            continue
        progress.global_step = state["global_step"]
        progress.step_lr = resume_policy.apply_optimizer_settings(
            learner.optimizer, learner.lr_scheduler, learner.peak_lr, (run.plan.adam_beta1, run.plan.adam_beta2),
            run.plan.adam_weight_decay, run.plan.adam_epsilon)
        run.data.source.load_state_dict(checkpointing.read_rank_state(path, accelerator.process_index))
        accelerator.wait_for_everyone()  # every rank has read its checkpoint before any folder moves
        if accelerator.is_main_process:
            abandoned = checkpointing.abandon_newer(config.output_dir, progress.global_step, (run.history.path,))
            if abandoned:
                accelerator.print(f"rolling back to step {progress.global_step}: the newer checkpoints (and a copy "
                                  f"of logs/history.jsonl) were moved to {abandoned}; nothing was deleted")
            run.history.truncate_after(progress.global_step)
        accelerator.print(f"resumed from {path} at optimizer step {progress.global_step} "
                          f"(epoch {state['epoch']}, batch {state['batch_in_epoch']})")
        for note in notes:
            accelerator.print(f"resume: {note}")
        for line in resume_policy.applied_change_lines(applied, progress.global_step + 1, progress.step_lr):
            accelerator.print(line)
        return
