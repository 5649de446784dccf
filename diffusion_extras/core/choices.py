"""The objective's and the optimizer's named options, importable without torch: the training
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
