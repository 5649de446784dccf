"""The evaluation's named options, importable without torch: the metric names and the guidance
default, which the training config validates against and declares as its default, and the sampling
schedulers, precisions and metric backbones that the sample and evaluate commands offer (so `--help`
and a bad flag answer before torch loads), and the custom pipelines' files, classes and conditioning
kinds (so the Hub push, which names them in the card, the training config, and the commands' checks
of a pipeline folder run without torch). tests/test_choices.py checks them against the modules that implement them
(metrics.py, sampling.py, backbones.py)."""
from __future__ import annotations

import ast
from pathlib import Path

# Metric -> the extractor it is computed in; None: the one --feature_extractor names (inception/tiny).
METRIC_EXTRACTORS = {"fid": None, "kid": None, "fd_dinov2": "dinov2", "cmmd": "clip"}
DINOV2_DEFAULT = "facebook/dinov2-large"  # fd_dinov2's backbone (Stein et al. 2023)
CLIP_DEFAULT = "openai/clip-vit-large-patch14-336"  # cmmd's backbone (Jayasumana et al. 2024)
SCHEDULERS = ("ddpm", "ddim", "dpm")  # sampling.make_scheduler's: ancestral, DDIM (eta 0), DPM-Solver++ (2M)
# sampling.make_scheduler's for flow-matching models: FlowMatchEulerDiscreteScheduler, and DPM-Solver++ (2M)
# on the flow sigmas (diffusers' use_flow_sigmas, prediction_type "flow_prediction")
FLOW_SCHEDULERS = ("euler", "dpm")
ALL_SCHEDULERS = tuple(dict.fromkeys(SCHEDULERS + FLOW_SCHEDULERS))  # the commands' --scheduler choices
# diffusers' timestep_spacing values: where a sampler's steps fall on the training schedule
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")
SAMPLING_DTYPES = ("fp32", "fp16", "bf16")  # sampling.DTYPES: the UNet's precision while sampling


def parse_metrics(text: str) -> list[str]:
    """'fid,kid,cmmd' -> ['fid', 'kid', 'cmmd'], refusing unknown names."""
    metrics = [m.strip() for m in str(text).split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRIC_EXTRACTORS]
    if not metrics or unknown:
        raise ValueError(f"--eval_metrics {text!r}: choose a comma list of {', '.join(METRIC_EXTRACTORS)}")
    return list(dict.fromkeys(metrics))


def extractors_for(metrics: list[str], feature_extractor: str) -> dict[str, list[str]]:
    """{extractor kind: the metrics computed in its features}, e.g. {'inception': ['fid'], 'clip': ['cmmd']}."""
    groups: dict[str, list[str]] = {}
    for metric in metrics:
        groups.setdefault(METRIC_EXTRACTORS[metric] or feature_extractor, []).append(metric)
    return groups


def _pipeline_constant(name: str, file: str = "pipeline_class_conditional.py"):
    """A constant that a pipeline file (pipeline_class_conditional.py, pipeline_latent.py) assigns,
    read from its source: the file is exported beside the pipelines and imports nothing of this
    package, so it declares the value, and reading it here costs a parse (milliseconds) instead of
    importing torch and diffusers (seconds)."""
    source = Path(__file__).with_name(file).read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise LookupError(f"{file} assigns no {name}")


DEFAULT_GUIDANCE_SCALE = _pipeline_constant("DEFAULT_GUIDANCE_SCALE")
PIPELINE_MODULE = _pipeline_constant("PIPELINE_MODULE")  # its file name in an exported folder (hub/push.py)
PIPELINE_CLASS = _pipeline_constant("PIPELINE_CLASS")  # its class name in model_index.json (cli/inputs.py)
LATENT_PIPELINE_CLASS = _pipeline_constant("PIPELINE_CLASS", "pipeline_latent.py")  # a latent export's (cli/inputs.py)
# an image-conditioned export's class, its kinds of condition (the trainer's --conditioning) and its guidance default
IMAGE_PIPELINE_CLASS = _pipeline_constant("PIPELINE_CLASS", "pipeline_image_conditioned.py")
IMAGE_PIPELINE_MODULE = _pipeline_constant("PIPELINE_MODULE", "pipeline_image_conditioned.py")
CONDITIONING_KINDS = _pipeline_constant("CONDITIONING_KINDS", "pipeline_image_conditioned.py")
DIT_PIPELINE_CLASS = _pipeline_constant("PIPELINE_CLASS", "pipeline_dit.py")  # a DiT export's (cli/inputs.py)
DIT_PIPELINE_MODULE = _pipeline_constant("PIPELINE_MODULE", "pipeline_dit.py")  # a DiT export's file (hub/push.py)
# the level a super-resolution export trained with conditioning augmentation gives its inputs by default
DEFAULT_NOISE_LEVEL = _pipeline_constant("DEFAULT_NOISE_LEVEL", "pipeline_image_conditioned.py")
DEFAULT_IMAGE_GUIDANCE_SCALE = _pipeline_constant("DEFAULT_IMAGE_GUIDANCE_SCALE", "pipeline_image_conditioned.py")
