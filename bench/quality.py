#!/usr/bin/env python
"""Sample quality of a digits recipe for a step or time budget, against the real-data floor.

    python bench/quality.py --max_train_steps 1200                # the default recipe
    python bench/quality.py --time_budget 300 -- --snr_gamma 0    # 5 minutes; flags after -- go to training
    python bench/quality.py --max_train_steps 1200 --config configs/digits-conditional.yaml   # class-conditional
    python bench/quality.py --max_train_steps 1200 --samplers euler:10,euler:20 -- --objective flow_matching

Trains the recipe with --validation_split 0.2 (a seeded fifth of the digits never trained on),
samples --num_samples EMA images (DDIM, 50 steps, seed 1; Euler for a flow-matching run; --samplers
scores several from the same noise) and scores them with a digit classifier:
logistic regression fitted on the TRAINING split, every image taken through the training
preprocessing and shrunk to 8x8 (snr_experiment.classifier_input). Reported:
  fid_classifier: Frechet distance of the classifier's 10 logits, samples vs the held-out digits;
  floor:          the same distance for real training-split digits vs the held-out digits, i.e. the
                  best a generator can score at this resolution and sample count;
  vae_floor:      (a latent run) the same distance for those real digits encoded and decoded by its
                  VAE: the best its latents allow;
  confident / coverage as in snr_experiment.py.
A latent run: `-- --pretrained_vae_model_name_or_path digits-vae` (bench/train_digits_vae.py).
A recipe change is judged by how far above the floor it ends, or the budget it needs to reach it.
--time_budget first times a short calibration run and trains the steps that fit (the LR schedule
then completes within the budget, as it would for a step budget).

A class-conditional run (its model_index.json names ClassConditionalPipeline) is sampled through
that exported pipeline instead: --num_samples split evenly over the classes, at each of
--guidance_scales with the same noise per image (DDIM 50, seed 1), and reported per guidance:
  accuracy:       the share of samples the classifier calls the requested class, overall and
                  per class (the classifier's accuracy on the real held-out digits is its ceiling);
  fid_classifier: as above, the class-balanced samples vs the held-out digits, and fid_ratio = it / floor.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from snr_experiment import classifier_input, score_digits  # noqa: E402

VALIDATION_SPLIT = 0.2


def train(out: str, steps: int, recipe: str | None, extra: list[str]) -> float:
    """Trains into `out` (skipped when a pipeline is there); returns the wall time in seconds."""
    if os.path.isfile(os.path.join(out, "model_index.json")):
        return float("nan")
    flags = ["--output_dir", out, "--max_train_steps", str(steps), "--validation_split", str(VALIDATION_SPLIT),
             "--save_images_steps", str(steps), "--checkpointing_steps", str(10 * steps), "--logger", "none"]
    command = [sys.executable, os.path.join(ROOT, "train_ddpm.py"), *(["--config", recipe] if recipe else []),
               *flags, *extra]
    started = time.perf_counter()
    with open(out.rstrip("/") + ".log", "w") as log:
        if subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=log).returncode:
            raise SystemExit(f"training {out} failed; see {out.rstrip('/')}.log")
    return time.perf_counter() - started


def steps_for_budget(out: str, seconds: float, recipe: str | None, extra: list[str], calibration_steps: int) -> dict:
    """Steps that fit in `seconds`, from the median images/s of a short calibration run (its
    start-up is left out of the rate and charged to the budget once)."""
    calibration = os.path.join(out, "calibration")
    wall = train(calibration, calibration_steps, recipe, extra)
    history = [json.loads(line) for line in open(os.path.join(calibration, "logs", "history.jsonl"))]
    rates = [r["images_per_second"] for r in history if "images_per_second" in r][1:]  # the first holds warm-up
    with open(os.path.join(calibration, "training_config.yaml")) as fh:
        import yaml
        batch = yaml.safe_load(fh)["train_batch_size"]
    step_seconds = batch / float(np.median(rates))
    startup = max(0.0, wall - calibration_steps * step_seconds)
    steps = max(1, int((seconds - startup) / step_seconds))
    return {"steps": steps, "seconds_per_step": step_seconds, "startup_seconds": startup}


def real_digits(recipe: str | None, extra: list[str]):
    """(training-split images, their labels, held-out images, their labels) exactly as the run split them."""
    from diffusion_extras.data import batch_order, decode_cache
    from diffusion_extras.data import images as data
    from diffusion_extras.training.config import parse_config

    config = parse_config([*(["--config", recipe] if recipe else []), *extra,
                           "--validation_split", str(VALIDATION_SPLIT)])
    if config.dataset_name or config.train_data_dir:
        raise SystemExit("bench/quality.py scores digits: leave out --dataset_name / --train_data_dir")
    dataset = data.load_image_dataset(config)
    images = decode_cache.decode_dataset(dataset, "image", config.resolution, True, 1)
    training, held_out = batch_order.split_held_out(images, config.validation_split, config.seed)
    as_array = lambda part: np.stack([part.image(i) for i in range(len(part))])  # noqa: E731
    labels = np.asarray(dataset["label"])
    return as_array(training), labels[training.rows], as_array(held_out), labels[held_out.rows]


def classifier_fid(classifier, images: np.ndarray, reference: np.ndarray) -> float:
    from diffusion_extras.evaluation import metrics as evaluation
    logits = [classifier.decision_function(classifier_input(part)) for part in (images, reference)]
    (mu1, sigma1), (mu2, sigma2) = (evaluation.feature_statistics(f) for f in logits)
    return evaluation.frechet_distance(mu1, sigma1, mu2, sigma2)


@dataclasses.dataclass
class DigitScorer:
    """The digit classifier with the held-out digits it measures against and the real-data floor."""
    classifier: object  # fitted sklearn classifier on classifier_input features
    held_out: np.ndarray  # uint8 [N, H, W, 1]
    held_out_labels: np.ndarray
    floor: float  # classifier FID of real training-split digits vs the held-out digits
    real: np.ndarray | None = None  # those training-split digits, uint8 [N, H, W, 1]

    @classmethod
    def for_recipe(cls, recipe: str | None, extra: list[str], num_samples: int) -> DigitScorer:
        """Logistic regression fitted on the run's training split; the floor for `num_samples` images."""
        from sklearn.linear_model import LogisticRegression

        training, labels, held_out, held_out_labels = real_digits(recipe, extra)
        classifier = LogisticRegression(max_iter=2000).fit(classifier_input(training), labels)
        real = training[np.random.default_rng(1).permutation(len(training))[:num_samples]]
        return cls(classifier, held_out, held_out_labels, classifier_fid(classifier, real, held_out), real)

    def predict(self, images: np.ndarray) -> np.ndarray:
        return self.classifier.predict(classifier_input(images))

    def fid(self, images: np.ndarray) -> float:
        return classifier_fid(self.classifier, images, self.held_out)


def default_sampler(run_dir: str) -> str:
    """The export's default sampler: DDIM, Euler for a flow-matching model."""
    from diffusers import DDPMScheduler

    from diffusion_extras.evaluation.sampling import default_scheduler
    return default_scheduler(DDPMScheduler.load_config(os.path.join(run_dir, "scheduler")))


def is_class_conditional(run_dir: str) -> bool:
    """The folder's model_index.json names ClassConditionalPipeline, or a DiTClassPipeline with classes
    (its id2label; an unconditional DiT's has none): a custom pipeline's [module, class]."""
    from diffusion_extras.evaluation.choices import DIT_PIPELINE_CLASS, PIPELINE_CLASS
    with open(os.path.join(run_dir, "model_index.json")) as fh:
        index = json.load(fh)
    name = index.get("_class_name")
    return isinstance(name, list) and (name[-1] == PIPELINE_CLASS
                                       or (name[-1] == DIT_PIPELINE_CLASS and bool(index.get("id2label"))))


def evaluate(run_dir: str, scorer: DigitScorer, num_samples: int, samplers: list[tuple[str, int]]) -> dict:
    """A pixel or latent export, of a UNet or a DiT (a latent one samples its latents and decodes them with its VAE),
    sampled by each (scheduler, steps) of `samplers` from the same noise (seed 1); the first one's
    scores are the report's top level, every one's under "samplers" ("ddim:50": {...})."""
    from diffusion_extras.cli.common import load_pipeline
    from diffusion_extras.evaluation import sampling
    from diffusion_extras.evaluation.pipeline_backbone import pipeline_model
    pipeline = load_pipeline(run_dir)
    by_sampler = {}
    for name, steps in samplers:
        scheduler = sampling.make_scheduler(name, pipeline.scheduler.config)
        started = time.perf_counter()
        samples = sampling.generate(pipeline_model(pipeline), scheduler, num_samples, steps, seed=1, batch_size=128,
                                    vae=getattr(pipeline, "vae", None))
        seconds = time.perf_counter() - started
        if not by_sampler:
            sampling.image_grid(samples[:64]).save(os.path.join(run_dir, "quality_samples_grid.png"))
        fid = scorer.fid(samples)
        by_sampler[f"{name}:{steps}"] = {"fid_classifier": fid, "fid_ratio": fid / scorer.floor,
                                         "sampling_seconds": seconds, **score_digits(scorer.classifier, samples)}
    report = {**next(iter(by_sampler.values())), "samplers": by_sampler,
              "real_confident_coverage": score_digits(scorer.classifier, scorer.held_out)}
    # the best its latents allow: the floor's digits through the VAE
    if getattr(pipeline, "vae", None) is not None and scorer.real is not None:
        report["vae_floor"] = scorer.fid(reconstructed(pipeline.vae, scorer.real))
    return report


def parse_samplers(text: str) -> list[tuple[str, int]]:
    """'ddim:10,ddim:50,euler:20' -> [('ddim', 10), ('ddim', 50), ('euler', 20)]."""
    from diffusion_extras.evaluation.choices import ALL_SCHEDULERS
    samplers = []
    for part in text.split(","):
        name, _, steps = part.strip().partition(":")
        if name not in ALL_SCHEDULERS or not steps.isdigit() or int(steps) < 1:
            raise SystemExit(f"--samplers {text!r}: give SCHEDULER:STEPS pairs, SCHEDULER one of "
                             f"{', '.join(ALL_SCHEDULERS)}")
        samplers.append((name, int(steps)))
    return samplers


def reconstructed(vae, images: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W, C] images encoded (posterior means) and decoded by `vae`."""
    import torch

    from diffusion_extras.data.batch_order import to_model_input
    from diffusion_extras.evaluation import sampling
    pixels = to_model_input(torch.from_numpy(images).permute(0, 3, 1, 2), vae.device).to(vae.dtype)
    with torch.no_grad():
        return sampling.to_uint8(vae.decode(vae.encode(pixels).latent_dist.mean).sample)


def export_checkpoint(recipe: str | None, extra: list[str], checkpoint: str, folder: str) -> str:
    """A ClassConditionalPipeline in `folder` with the EMA weights of a training checkpoint
    (checkpointing.checkpoint_model), for measuring a run that has not finished, or an earlier step as
    an autoguidance guide."""
    from diffusion_extras.data import images as data
    from diffusion_extras.data.labels import class_labels
    from diffusion_extras.training import models
    from diffusion_extras.training.checkpointing import checkpoint_model
    from diffusion_extras.training.config import parse_config
    if os.path.isfile(os.path.join(folder, "model_index.json")):
        return folder
    config = parse_config([*(["--config", recipe] if recipe else []), *extra])
    _, names = class_labels(data.load_image_dataset(config), config.label_column)
    unet, weights = checkpoint_model(checkpoint)
    if weights != "EMA":
        raise ValueError(f"{checkpoint} holds no EMA weights (its run had use_ema off)")
    models.save_class_conditional(unet, models.build_noise_scheduler(config), names, folder)
    return folder


def pipeline_sampler(run_dir: str, seed: int = 1, num_inference_steps: int = 50, batch_size: int = 100,
                     scheduler: str | None = None, guide: str | None = None):
    """(sample, number of classes) for the exported ClassConditionalPipeline with `scheduler`
    ("pipeline": its own; None: DDIM, Euler for a flow model) swapped in from its config as users
    do: sample(class_labels, guidance_scale, **call) -> uint8 [N, H, W, C], `call` going to the
    pipeline (guidance_interval, autoguidance). `guide`: a pipeline folder whose UNet becomes
    pipeline.guide. Image i has its own generator (seeded from (seed, i)), so its noise is the same at
    every guidance scale and batch size."""
    import torch

    from diffusion_extras.cli.common import load_pipeline
    from diffusion_extras.evaluation import sampling
    from diffusion_extras.evaluation.pipeline_backbone import null_class, pipeline_model
    pipeline = load_pipeline(run_dir)  # a UNet's ClassConditionalPipeline or a DiT's DiTClassPipeline
    if scheduler != "pipeline":
        pipeline.scheduler = sampling.make_scheduler(scheduler, pipeline.scheduler.config)
    if guide:
        pipeline.guide = pipeline_model(load_pipeline(guide))
    pipeline.set_progress_bar_config(disable=True)

    def sample(class_labels: list[int], guidance_scale: float, **call) -> np.ndarray:
        chunks = []
        for first in range(0, len(class_labels), batch_size):
            labels = class_labels[first:first + batch_size]
            generators = [torch.Generator().manual_seed(sampling.image_seed(seed, index))
                          for index in range(first, first + len(labels))]
            images = pipeline(class_labels=labels, guidance_scale=guidance_scale, generator=generators,
                              num_inference_steps=num_inference_steps, output_type="np", **call).images
            chunks.append((images * 255).round().astype(np.uint8))
        return np.concatenate(chunks)
    return sample, null_class(pipeline_model(pipeline))


def per_class_accuracy(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> list[float]:
    return [float((predicted[labels == k] == k).mean()) if (labels == k).any() else float("nan")
            for k in range(num_classes)]


def evaluate_conditional(sample, num_classes: int, scorer: DigitScorer, num_samples: int,
                         guidance_scales: list[float], grid_dir: str | None = None, **call) -> dict:
    """Per guidance scale: how often the classifier calls each sample the class it was asked for,
    and the classifier FID of the class-balanced samples against the floor."""
    from diffusion_extras.evaluation import sampling
    per_class = num_samples // num_classes
    if per_class < 1:
        raise SystemExit(f"--num_samples {num_samples} gives no sample per class; give at least {num_classes}")
    labels = np.repeat(np.arange(num_classes), per_class)
    guidance = {}
    for scale in guidance_scales:
        images = sample(labels.tolist(), scale, **call)
        predicted = scorer.predict(images)
        fid = scorer.fid(images)
        guidance[str(scale)] = {"accuracy": float((predicted == labels).mean()), "fid_classifier": fid,
                                "fid_ratio": fid / scorer.floor,
                                "per_class_accuracy": per_class_accuracy(predicted, labels, num_classes)}
        if grid_dir:  # one row per class, up to 10 images each
            rows = np.concatenate([images[labels == k][:10] for k in range(num_classes)])
            sampling.image_grid(rows, nrow=min(per_class, 10)).save(
                os.path.join(grid_dir, f"quality_samples_guidance_{scale}.png"))
    real = scorer.predict(scorer.held_out)
    return {"guidance": guidance, "best_guidance": max(guidance, key=lambda s: guidance[s]["accuracy"]),
            "samples_per_class": per_class,
            "real_held_out_accuracy": float((real == scorer.held_out_labels).mean()),
            "real_held_out_per_class_accuracy": per_class_accuracy(real, scorer.held_out_labels, num_classes)}


def conditional_table(report: dict, floor: float) -> str:
    """Markdown: one row per guidance scale, then the real digits (accuracy on the held-out split,
    FID of the training split: the floor)."""
    def worst(per_class: list[float]) -> str:
        k = int(np.nanargmin(per_class))
        return f"{k}: {per_class[k]:.2f}"
    lines = ["| guidance | class accuracy | worst class | classifier FID | FID ratio (/ floor) |",
             "|---|---|---|---|---|"]
    for scale, row in report["guidance"].items():
        lines.append(f"| {scale} | {row['accuracy']:.3f} | {worst(row['per_class_accuracy'])} "
                     f"| {row['fid_classifier']:.3f} | {row['fid_ratio']:.3f} |")
    lines.append(f"| real digits | {report['real_held_out_accuracy']:.3f} (held-out) "
                 f"| {worst(report['real_held_out_per_class_accuracy'])} | {floor:.3f} (training split) | 1 |")
    return "\n".join(lines)


def guidance_variants(args, extra: list[str], run_dir: str, scorer: DigitScorer, scales: list[float]) -> dict:
    """{"SCHEDULER/VARIANT/seed N": evaluate_conditional report}: CFG, CFG within --guidance_interval
    and autoguidance with --guide_checkpoint's EMA, per scheduler and seed (the same noise per
    image across variants and scales)."""
    guide = (export_checkpoint(args.config, extra, args.guide_checkpoint, args.guide_checkpoint.rstrip("/") + "-ema")
             if args.guide_checkpoint else None)
    # autoguidance=False: with a guide set, the pipeline guides with it by default (a saved guide/ is
    # used unless the call says otherwise), which made these rows autoguidance rows.
    variants = {"cfg": {"autoguidance": False}}
    if args.guidance_interval:
        low, high = (float(part) for part in args.guidance_interval.split(","))
        variants[f"cfg+interval({low},{high}]"] = {"guidance_interval": (low, high), "autoguidance": False}
    if guide:
        variants["autoguidance"] = {"autoguidance": True}
    report = {}
    for scheduler in args.schedulers.split(","):
        for seed in (int(part) for part in args.seeds.split(",")):
            sample, num_classes = pipeline_sampler(run_dir, seed=seed, scheduler=scheduler, guide=guide)
            for name, call in variants.items():
                row = report[f"{scheduler}/{name}/seed {seed}"] = evaluate_conditional(
                    sample, num_classes, scorer, args.num_samples, scales, **call)
                print(f"{scheduler}/{name}/seed {seed}:", {scale: (round(r["accuracy"], 3), round(r["fid_ratio"], 3))
                                                          for scale, r in row["guidance"].items()}, flush=True)
    return report


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--max_train_steps", type=int, help="step budget")
    budget.add_argument("--time_budget", type=float, help="seconds of training (start-up included)")
    parser.add_argument("--config", default=None, help="YAML recipe (default: the embedded digits recipe)")
    parser.add_argument("--num_samples", type=int, default=1000, help="generated images scored")
    parser.add_argument("--guidance_scales", default="1,2,4",
                        help="comma-separated classifier-free guidance scales (class-conditional runs)")
    parser.add_argument("--samplers", default=None, metavar="SCHEDULER:STEPS,...",
                        help="unconditional and latent runs: the samplers scored, each from the same noise "
                             "(default ddim:50, euler:50 for a flow-matching run), e.g. euler:10,euler:20,euler:50")
    parser.add_argument("--schedulers", default="ddim",
                        help="class-conditional: comma list of ddim, ddpm, dpm, pipeline (its own), swapped in from "
                             "the pipeline's config")
    parser.add_argument("--guidance_interval", default=None, metavar="LOW,HIGH",
                        help="class-conditional: also score CFG guided only at sigma in (LOW, HIGH]")
    parser.add_argument("--guide_checkpoint", default=None,
                        help="class-conditional: also score autoguidance with this training checkpoint's EMA")
    parser.add_argument("--from_checkpoint", default=None,
                        help="score this checkpoint's EMA (exported beside it) instead of the finished run")
    parser.add_argument("--seeds", default="1", help="comma list of sampling seeds (the noise of image i: (seed, i))")
    parser.add_argument("--calibration_steps", type=int, default=30, help="steps of the --time_budget timing run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "quality"))
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    os.makedirs(args.out, exist_ok=True)
    result = {"recipe": args.config or "digits (defaults)", "extra_flags": extra}
    steps = args.max_train_steps
    if args.time_budget is not None:
        result["time_budget"] = {"seconds": args.time_budget, **steps_for_budget(
            args.out, args.time_budget, args.config, extra, args.calibration_steps)}
        steps = result["time_budget"]["steps"]
    run_dir = os.path.join(args.out, f"run-{steps}")
    result.update(steps=steps, train_seconds=float("nan") if args.from_checkpoint else train(
        run_dir, steps, args.config, extra))
    scorer = DigitScorer.for_recipe(args.config, extra, args.num_samples)
    result.update(floor=scorer.floor, held_out_images=len(scorer.held_out), num_samples=args.num_samples)
    if args.from_checkpoint:
        run_dir = export_checkpoint(args.config, extra, args.from_checkpoint, args.from_checkpoint.rstrip("/") + "-ema")
        result["from_checkpoint"] = args.from_checkpoint
    if is_class_conditional(run_dir):
        scales = [float(scale) for scale in args.guidance_scales.split(",")]
        sample, num_classes = pipeline_sampler(run_dir)
        result["class_conditional"] = evaluate_conditional(sample, num_classes, scorer, args.num_samples, scales,
                                                           grid_dir=run_dir)
        result["variants"] = guidance_variants(args, extra, run_dir, scorer, scales)
    else:
        result.update(evaluate(run_dir, scorer, args.num_samples, parse_samplers(args.samplers) if args.samplers
                               else [(default_sampler(run_dir), 50)]))
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))
    if "class_conditional" in result:
        print(conditional_table(result["class_conditional"], result["floor"]))
        for name, report in result["variants"].items():
            print(f"\n{name}\n" + conditional_table(report, result["floor"]))
        print(f"real-data floor {result['floor']:.3f} after {steps} steps")
    else:
        for name, row in result["samplers"].items():
            print(f"{name}: classifier FID {row['fid_classifier']:.3f}, {row['fid_ratio']:.3f} x the floor")
        print(f"classifier FID {result['fid_classifier']:.3f} after {steps} steps; "
              f"real-data floor {result['floor']:.3f}"
              + (f"; the VAE's reconstructions {result['vae_floor']:.3f}" if "vae_floor" in result else ""))


if __name__ == "__main__":
    main()
