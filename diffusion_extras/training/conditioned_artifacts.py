"""What a conditional run (--conditioning) samples and scores besides the unconditional artifacts
(artifacts.py): the grid of condition | sample | target, and the evaluation of the samples made from
the conditions of held-out (else training) images. Both sample through the exported pipeline's own
__call__ (evaluation/conditioned.py) on every rank, as the unconditional grid and FID do."""
from __future__ import annotations

import numpy as np

from diffusion_extras.core import stop_flag
from diffusion_extras.evaluation import conditioned, distributed, sampling
from diffusion_extras.evaluation import metrics as evaluation
from diffusion_extras.training.artifacts import Target, sample_rows, write_grid
from diffusion_extras.training.conditioning import ImageCondition, conditions_of
from diffusion_extras.training.sampling_copy import SamplingCopy


def save_conditioned_grid(unet, ema, noise_scheduler, target: Target, images: np.ndarray, condition: ImageCondition,
                          num_inference_steps: int, seed: int, guidance_scale: float = 1.0,
                          sampling_copy: SamplingCopy | None = None, rank: int = 0, num_ranks: int = 1,
                          vae=None) -> str | None:
    """A conditional run's grid (as artifacts.save_sample_grid: EMA, fp32, DDIM, every rank its
    rows): each of the stored `images` [N, C + S, H, W] (held-out or training images) as condition |
    sample | target, the sample made by the exported pipeline's __call__ from the condition
    (`condition`: the run's ImageCondition; fixed masks from `seed`), grid_columns(N) such triplets
    a row."""
    inputs = conditions_of(condition, images, seed)
    per_row = sampling.grid_columns(len(images))
    with stop_flag.interruptible(), (sampling_copy or SamplingCopy())(unet, ema) as copy:
        pipeline = conditioned.conditioned_pipeline(copy, sampling.training_sampler(noise_scheduler.config), vae,
                                                    condition.pipeline_config())
        rows = sample_rows(lambda first, count: conditioned.sample_conditioned(
            pipeline, conditioned.batch(inputs, first, count), range(first, first + count), num_inference_steps, seed,
            guidance_scale), len(images), per_row, rank, num_ranks)
    if num_ranks > 1:
        rows = distributed.gather_to_main(rows, rank, num_ranks)
    if rank != 0:
        return None
    samples = np.concatenate([rows[first] for first in sorted(rows)])
    shown, targets = (conditioned.to_uint8(inputs[name]) for name in ("shown", "images"))
    return write_grid(np.stack([shown, samples, targets], axis=1).reshape(-1, *samples.shape[1:]), 3 * per_row, target)


def evaluate_conditioned(unet, ema, noise_scheduler, suites, target: Target, images: np.ndarray,
                         condition: ImageCondition, num_inference_steps: int, seed: int, batch_size: int,
                         guidance_scale: float = 1.0,
                         sampling_copy: SamplingCopy | None = None, vae=None) -> tuple[dict, dict] | tuple[None, None]:
    """A conditional run's evaluation (as artifacts.evaluate: EMA, DDIM, every rank its batches): the
    samples of the conditions of the stored `images` [N, C + S, H, W] (held-out or training images;
    `condition`: the run's ImageCondition, fixed masks from `seed`), scored against those images
    (evaluation/conditioned.py scores: PSNR, SSIM, the bicubic baseline, a digit classifier's
    accuracy) and by --eval_metrics against the reference statistics."""
    accelerator = target.accelerator
    rank, num_ranks = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    inputs = conditions_of(condition, images, seed)
    with (sampling_copy or SamplingCopy())(unet, ema) as copy:
        pipeline = conditioned.conditioned_pipeline(copy, sampling.training_sampler(noise_scheduler.config),
                                                    vae, condition.pipeline_config())
        samples = conditioned.conditioned_samples(pipeline, {k: v for k, v in inputs.items() if k != "shown"},
                                                  num_inference_steps, seed, guidance_scale, batch_size, rank,
                                                  num_ranks)
    if samples is None:  # not the main process
        return None, None
    metrics = conditioned.scores(condition.kind, samples, conditioned.to_uint8(inputs["images"]), condition.sr_factor)
    evaluation.check_suites(suites)
    for extractor, reference, wanted in suites:
        metrics.update(evaluation.score(evaluation.extract_all([samples], extractor), reference, wanted, seed))
    metrics["num_samples"] = len(samples)
    target.log_values({f"eval/{k}": float(v) for k, v in metrics.items()})
    names = {metric: extractor.name for extractor, _, group in suites for metric in group}
    return metrics, {f"{k} ({names[k]})" if k in names else k: v for k, v in metrics.items()}
