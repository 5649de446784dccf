"""The health report's words for the run's training objective (--objective): the objective rebuilt from
the saved config (core/objectives.py: its loss weight and Bayes-optimal loss per training index), how a
bin of training indices is named (DDPM timesteps, flow-matching sigmas) and which flags move the loss
between noise levels. The checks ask `terms_for(config)` instead of branching on the objective; a new
objective adds its class here beside its class in core/objectives.py.

torch and diffusers (seconds) load only where the objective is rebuilt, so that
`python -m diffusion_extras.report --help` answers at once (tests/test_first_contact.py)."""
from __future__ import annotations


def train_timesteps(config: dict) -> int:
    """The run's number of training indices (--ddpm_num_steps; a scheduler config's name for it)."""
    return int(config.get("ddpm_num_steps") or config.get("num_train_timesteps") or 1000)


class DDPMTerms:
    """--objective ddpm: bins of timesteps t; min-SNR and the prediction type rebalance them."""
    name = "ddpm"

    @staticmethod
    def scheduler(config: dict, num_train_timesteps: int):
        from diffusion_extras.core import losses

        return losses.ddpm_scheduler(num_train_timesteps, config.get("ddpm_beta_schedule", "linear"),
                                     config.get("prediction_type", "epsilon"),
                                     config.get("rescale_betas_zero_snr", False))

    @staticmethod
    def bin_range(objective, lo: int, hi: int) -> str:
        """Bin [lo, hi) of training indices, as the report names it."""
        return f"{lo}-{hi - 1}"

    unit = "timesteps"

    @staticmethod
    def noisy_fix(config: dict) -> str:
        gamma, prediction_type = config.get("snr_gamma"), config.get("prediction_type", "epsilon")
        shift = (f"Min-SNR is on (--snr_gamma {gamma}); a lower --snr_gamma (e.g. 2) moves more weight to them"
                 if gamma else "Shift the loss weight toward them with --snr_gamma 5 (Min-SNR, Hang et al. "
                 "2023, caps the weight of low-noise timesteps)")
        return ("These noisy timesteps set the samples' global layout. " + shift
                + (", or switch to --prediction_type v_prediction (an "
                   "epsilon error there is amplified sqrt((1-abar)/abar) times in the image estimate)"
                   if prediction_type == "epsilon" else "") + "; and train longer (--max_train_steps).")

    @staticmethod
    def clean_fix(config: dict) -> str:
        gamma = config.get("snr_gamma")
        return ("These low-noise timesteps carry fine detail: train longer (--max_train_steps)" +
                (f"; --snr_gamma {gamma} down-weights them, so raise it or drop it" if gamma else "") + ".")

    @staticmethod
    def noisy_loss_fix(config: dict) -> str:
        """What besides a larger batch calms a loss log that scatters."""
        return ("" if config.get("snr_gamma") else
                ", and consider --snr_gamma 5 (Min-SNR, Hang et al. 2023, tames the large low-noise losses)")

    @staticmethod
    def gradient_fix(config: dict, top: int, num_bins: int) -> str:
        """How to rebalance when the bin `top` carries most of the gradient."""
        gamma = config.get("snr_gamma")
        return ("turn on min-SNR weighting, --snr_gamma 5" if not gamma else
                f"lower --snr_gamma (now {gamma})" if top < num_bins // 2 else
                "check --prediction_type (v_prediction balances the noisy end) and --rescale_betas_zero_snr")


class FlowMatchingTerms:
    """--objective flow_matching: bins of noise levels sigma (index i: the shifted (i + 1) / T); how
    often each level is drawn (--weighting_scheme, --logit_mean, --flow_shift) rebalances them."""
    name = "flow_matching"
    unit = "sigma"

    @staticmethod
    def scheduler(config: dict, num_train_timesteps: int):
        from diffusion_extras.core.objectives import flow_scheduler

        return flow_scheduler(num_train_timesteps, float(config.get("flow_shift") or 1.0))

    @staticmethod
    def bin_range(objective, lo: int, hi: int) -> str:
        import torch

        low, high = objective.coefficients(torch.tensor([lo, hi - 1]))[1].tolist()
        return f"{low:.2f}-{high:.2f}"

    @staticmethod
    def noisy_fix(config: dict) -> str:
        return ("These noisy levels set the samples' global layout. Draw them more often: a larger --flow_shift "
                f"(now {config.get('flow_shift') or 1.0:g}; SD3 trains at 3 at 1024 px) or a higher --logit_mean "
                f"(now {config.get('logit_mean') or 0.0:g}) under --weighting_scheme logit_normal; and train longer "
                "(--max_train_steps).")

    @staticmethod
    def clean_fix(config: dict) -> str:
        return ("These low-noise levels carry fine detail: train longer (--max_train_steps), or draw them more "
                f"often with a lower --logit_mean (now {config.get('logit_mean') or 0.0:g}) or --flow_shift "
                f"(now {config.get('flow_shift') or 1.0:g}).")

    @staticmethod
    def noisy_loss_fix(config: dict) -> str:
        return ""  # the velocity's loss has no low-noise blow-up for a weight to tame

    @staticmethod
    def gradient_fix(config: dict, top: int, num_bins: int) -> str:
        direction = "lower" if top >= num_bins // 2 else "higher"
        return (f"draw the other noise levels more often: a {direction} --logit_mean (now "
                f"{config.get('logit_mean') or 0.0:g}) or --flow_shift (now {config.get('flow_shift') or 1.0:g}), "
                "or --weighting_scheme cosmap")


TERMS = {terms.name: terms for terms in (DDPMTerms, FlowMatchingTerms)}


def terms_for(config: dict):
    """The report's terms for the run's objective (a run from before --objective: DDPM)."""
    return TERMS[config.get("objective") or "ddpm"]


def run_objective(config: dict, num_train_timesteps: int):
    """The run's objective (core/objectives.py) on its noise schedule, rebuilt from its saved config."""
    from diffusion_extras.core import objectives

    terms = terms_for(config)
    settings = {name: config[name] for name in objectives.OBJECTIVES[terms.name].settings if name in config}
    return objectives.make_objective(terms.name, terms.scheduler(config, num_train_timesteps), "cpu", **settings)


def bin_ranges(config: dict, objective, edges, bins) -> list[str]:
    """The report's name of each bin in `bins` (indices into `edges`, the bins' index edges) of the
    run's `objective` (run_objective)."""
    return [terms_for(config).bin_range(objective, int(edges[i]), int(edges[i + 1])) for i in bins]
