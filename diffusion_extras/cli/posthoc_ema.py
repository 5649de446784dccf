"""Command line: reconstruct post-hoc EMA weights of a training run (`phema.py`), optionally score
each width with FID/KID, and export the best: the run's own pipeline (DDPMPipeline, or the
class-conditional, latent or image-conditioned one, with its scheduler, VAE and pipeline files) with
the reconstructed UNet in place of the run's.

    python -m diffusion_extras.posthoc_ema OUTPUT_DIR --sigma_rels 0.05,0.1,0.15 --evaluate \\
        --reference DIR_OR_STATS.npz
"""
from __future__ import annotations

import argparse
import copy
import json
import os
from typing import TYPE_CHECKING

from diffusion_extras.cli.arguments import add_device_argument, one_line_errors, positive_int
from diffusion_extras.core.commands import importing_the_stack, leaves_the_process_as_found, prog_name

if TYPE_CHECKING:
    import torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog_name("posthoc_ema"),
        description="Reconstruct post-hoc EMA weights of a training run, optionally score each "
                    "width with FID/KID, and export the best: the run's own pipeline with the reconstructed "
                    "UNet.")
    parser.add_argument("output_dir", help="training output dir: its exported pipeline plus the "
                                           "snapshots in OUTPUT_DIR/posthoc_ema/")
    parser.add_argument("--sigma_rels", required=True, help="comma-separated relative EMA "
                                                            "widths, e.g. 0.05,0.1,0.15")
    parser.add_argument("--step", type=int, default=None, help="snapshot step (default: last)")
    parser.add_argument("--evaluate", action="store_true", help="score each width, export best")
    parser.add_argument("--num_samples", type=positive_int, default=256, help="generated images per width")
    parser.add_argument("--num_inference_steps", type=positive_int, default=100, help="sampler steps")
    parser.add_argument("--feature_extractor", choices=("tiny", "inception"), default="inception")
    parser.add_argument("--inception_weights", default=None, help="local Inception weights file")
    parser.add_argument("--reference", default=None, help="reference images dir or stats .npz")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed, same for every width")
    parser.add_argument("--batch_size", type=positive_int, default=64, help="sampling batch size")
    add_device_argument(parser)
    parser.add_argument("--export", default=None, help="default: OUTPUT_DIR/posthoc-ema-best")
    return parser


def _parse_args(argv):
    args = build_parser().parse_args(argv)
    # torch, scipy, diffusers (seconds) once the flags parse: --help and a bad flag answer at once
    from diffusion_extras.core.phema import sigma_rel_to_gamma

    try:
        args.sigma_rels = [float(v) for v in args.sigma_rels.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sigma_rels must be comma-separated numbers, got "
                         f"{args.sigma_rels!r}") from None
    for sigma_rel in args.sigma_rels:
        sigma_rel_to_gamma(sigma_rel)  # range check with a one-line message
    if not args.evaluate and len(args.sigma_rels) != 1:
        raise ValueError("without --evaluate pass exactly one --sigma_rels value to export")
    if args.evaluate and args.reference is None:
        raise ValueError("--evaluate needs --reference (a directory of images or a stats .npz)")
    args.export = args.export or os.path.join(args.output_dir, "posthoc-ema-best")
    return args


def _with_parameters(model, state: dict[str, torch.Tensor]):
    """A copy of `model` whose parameters are `state`; buffers and config stay the pipeline's."""
    import torch

    model = copy.deepcopy(model)
    parameters = dict(model.named_parameters())
    missing, unknown = parameters.keys() - state.keys(), state.keys() - parameters.keys()
    if missing or unknown:
        raise ValueError(f"snapshots do not match the saved model: {len(missing)} parameters "
                         f"missing, {len(unknown)} unknown (e.g. {sorted(missing | unknown)[0]})")
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(state[name])
    return model


def export_with_model(source: str, model, export: str) -> None:
    """The pipeline folder `source` copied to `export` with `model` in place of its unet/ (a DiT's
    transformer/): the model_index.json, the exported pipeline files, the scheduler, VAE and guide
    as the run saved them, so the export keeps the run's pipeline kind (a DDPMPipeline around the
    averaged UNet lost a class-conditional, latent, image-conditioned or DiT run's)."""
    import shutil

    from diffusion_extras.evaluation.pipeline_backbone import backbone_of

    component = backbone_of(model).component
    with open(os.path.join(source, "model_index.json")) as fh:
        components = [name for name, value in json.load(fh).items()
                      if isinstance(value, list) and not name.startswith("_")]
    os.makedirs(export, exist_ok=True)
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if name == "model_index.json" or (name.endswith(".py") and os.path.isfile(path)):
            shutil.copy2(path, os.path.join(export, name))
        elif name in components and name != component and os.path.isdir(path):
            shutil.copytree(path, os.path.join(export, name), dirs_exist_ok=True)
    model.save_pretrained(os.path.join(export, component))


def _run(args) -> None:
    with importing_the_stack():
        from diffusion_extras.cli.common import load_pipeline, load_reference, pipeline_resolution, resolve_device
        from diffusion_extras.cli.inputs import check_pipeline_folder
        from diffusion_extras.core.phema import reconstruct, require_snapshots, sigma_rel_to_gamma, solve_weights
        from diffusion_extras.evaluation import metrics as evaluation
        from diffusion_extras.evaluation.choices import DEFAULT_GUIDANCE_SCALE
        from diffusion_extras.evaluation.pipeline_backbone import pipeline_model
        from diffusion_extras.evaluation.pipeline_image_conditioned import ImageConditionedPipeline

    check_pipeline_folder(args.output_dir)
    snapshot_dir = os.path.join(args.output_dir, "posthoc_ema")
    snapshots = require_snapshots(snapshot_dir)
    step = max(s.step for s in snapshots) if args.step is None else args.step
    for sigma_rel in args.sigma_rels:  # reject a bad --step before the slow loads
        solve_weights([s.step for s in snapshots], [s.gamma for s in snapshots], step, sigma_rel)
    pipeline = load_pipeline(args.output_dir)
    if args.evaluate and isinstance(pipeline, ImageConditionedPipeline):
        raise ValueError("--evaluate scores unconditional samples; an image-conditioned run is scored on its "
                         "conditions: export one width and run `python -m diffusion_extras.evaluate` on it")
    # a class-conditional run is scored on class-balanced samples at the default guidance
    num_classes = len(pipeline.id2label) if getattr(pipeline, "id2label", None) else None
    if args.evaluate:  # only scoring loads the feature extractors
        args.device = resolve_device(args.device)
        extractor = evaluation.build_feature_extractor(
            args.feature_extractor, args.inception_weights, args.device)
        # A folder of images is resized like the training data and its statistics cached.
        reference = load_reference(args.reference, extractor, pipeline_resolution(pipeline),
                                   args.output_dir, args.batch_size)
        vae = getattr(pipeline, "vae", None)
        vae = vae.to(args.device) if vae is not None else None
    results, best, best_model = [], None, None
    for sigma_rel in args.sigma_rels:
        model = _with_parameters(pipeline_model(pipeline), reconstruct(snapshot_dir, sigma_rel, step))
        row = {"sigma_rel": sigma_rel}
        if args.evaluate:
            scores = evaluation.evaluate_unet_metrics(
                model.to(args.device), pipeline.scheduler, [(extractor, reference, ["fid", "kid"])],
                args.num_samples, args.num_inference_steps, args.seed, args.batch_size, args.device,
                num_classes, DEFAULT_GUIDANCE_SCALE if num_classes else 1.0, vae=vae)
            row.update({k: float(v) for k, v in scores.items() if isinstance(v, (int, float))})
        results.append(row)
        if best_model is None or (args.evaluate and row["fid"] < best["fid"]):
            best, best_model = row, model.to("cpu")
    print(f"{'sigma_rel':>9}  {'fid':>10}  {'kid':>10}")
    for row in results:
        fid, kid = (f"{row[k]:10.4f}" if k in row else f"{'-':>10}" for k in ("fid", "kid"))
        print(f"{row['sigma_rel']:9.4f}  {fid}  {kid}")
    export_with_model(args.output_dir, best_model, args.export)
    summary = {"sigma_rel": best["sigma_rel"], "gamma": sigma_rel_to_gamma(best["sigma_rel"]),
               "step": step, "chosen_by": "lowest fid" if args.evaluate else "requested",
               "scores": results}
    with open(os.path.normpath(args.export) + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    print(f"exported sigma_rel={best['sigma_rel']} (step {step}) to {args.export}")


@leaves_the_process_as_found
def main(argv=None) -> None:
    with one_line_errors():
        _run(_parse_args(argv))
