"""The objective's, the optimizer's and the backbone's named options, importable without torch: the training
config validates its flags against these (so `--help` and a bad flag answer before torch loads),
and the modules that implement the options import them from here. tests/test_choices.py checks
them against diffusers' own names and against the implementations."""

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")  # what the UNet predicts (diffusers' names)
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid", "laplace")  # DDPMScheduler's
LOSS_TYPES = ("l2", "huber")  # losses.per_sample_loss
VARIANCE_TYPES = ("fixed_small", "fixed_large", "learned_range")  # DDPMScheduler's names; vlb.py's bound
TIMESTEP_SAMPLING = ("uniform", "loss_aware")  # timesteps.SAMPLERS
# diffusers.optimization.get_scheduler's names offered by --lr_scheduler: all but piecewise_constant,
# whose step rules no flag gives
LR_SCHEDULERS = ("cosine", "constant_with_warmup", "linear", "constant", "cosine_with_restarts", "polynomial")
# --objective: what the network is trained on (core/objectives.py OBJECTIVES, in this order)
OBJECTIVE_NAMES = ("ddpm", "flow_matching")
# --weighting_scheme of flow matching: diffusers.training_utils' names (its SD3 scripts' flag)
WEIGHTING_SCHEMES = ("logit_normal", "mode", "cosmap", "sigma_sqrt", "none")
MODEL_TYPES = ("unet", "dit")  # the denoising backbone: UNet2DModel, DiTTransformer2DModel (training/backbones.py)
# DiT's sizes by the paper's names (Peebles & Xie 2023, Table 1): (depth, hidden size, heads), each
# with a patch size: "S/2", ..., "XL/8"
DIT_SHAPES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
DIT_PATCH_SIZES = (2, 4, 8)
DIT_SIZES = tuple(f"{name}/{patch}" for name in DIT_SHAPES for patch in DIT_PATCH_SIZES)
