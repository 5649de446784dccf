import dataclasses
import os

import pytest
import yaml
from helpers import tiny_unet

from diffusion_extras.training import models
from diffusion_extras.training.config import (
    ConfigError,
    TrainConfig,
    build_parser,
    from_sources,
    load_yaml,
    parse_config,
    save_config,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe(name):
    return from_sources(load_yaml(os.path.join(ROOT, "configs", name)), {})


def test_digits_recipe_equals_defaults():
    assert recipe("digits.yaml") == TrainConfig()


def test_the_flow_recipe_is_the_digits_recipe_with_flow_matching():
    """configs/digits-flow.yaml changes the objective (and the output folder) only: the comparison
    with the DDPM default in docs/BENCHMARKS.md is of the objective alone."""
    config = parse_config(["--config", os.path.join(ROOT, "configs", "digits-flow.yaml")])
    differences = {f.name for f in dataclasses.fields(TrainConfig)
                   if getattr(config, f.name) != getattr(TrainConfig(), f.name)}
    assert differences == {"objective", "output_dir"} and config.objective == "flow_matching"


def test_cifar10_recipe_builds_the_papers_35_7m_unet():
    config = recipe("cifar10-ddpm.yaml")
    unet = models.build_unet(config)
    assert round(models.count_parameters(unet) / 1e6, 1) == 35.7
    assert (config.train_batch_size, config.learning_rate, config.lr_warmup_steps) == (128, 2e-4, 5000)
    assert (config.max_grad_norm, config.ema_max_decay, unet.config.dropout) == (1.0, 0.9999, 0.1)
    assert list(unet.config.block_out_channels) == [128, 256, 256, 256]
    # attention only at 16 px: the second level of a 32 px input
    assert list(unet.config.down_block_types) == ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"]


@pytest.mark.parametrize("name,resolution", [("ddpm-64.yaml", 64), ("ddpm-256.yaml", 256)])
def test_large_recipes_validate_and_build(name, resolution):
    config = recipe(name)
    assert config.resolution == resolution
    assert models.build_unet(config).config.sample_size == resolution


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("learning_rate: 3.0e-4\ntrain_batch_size: 16\nuse_ema: false\n")
    config = parse_config(["--config", str(path), "--train_batch_size", "4"])
    assert (config.learning_rate, config.train_batch_size, config.use_ema) == (3e-4, 4, False)
    assert config.resolution == TrainConfig().resolution
    assert parse_config(["--config", str(path), "--use_ema"]).use_ema is True


def non_default(field) -> tuple:
    """A value of `field` other than its default, and the flags that give it."""
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    kind = field.type.replace(" | None", "").removeprefix("Optional[").removesuffix("]")  # "int | None": int
    flag = f"--{field.name}"
    if kind == "bool":
        return (not default), [flag if not default else f"--no-{field.name}"]
    if kind == "int":
        value = 7 if default is None else default + 1
    elif kind == "float":
        value = 0.5 if default is None else default + 0.25
    elif field.metadata["choices"]:
        value = next(choice for choice in field.metadata["choices"] if choice != default)
    elif kind == "Resolution":  # N or (height, width): a pair, given as H,W
        value = (default, default * 2)
        return value, [flag, f"{value[0]},{value[1]}"]
    else:
        value = f"{default}-changed"
    return value, [flag, str(value)]


def test_every_flag_maps_to_a_field(monkeypatch):
    """Every TrainConfig field but `model` (YAML only) has a flag of its name, the parser has no
    other flag, and a non-default value given on the command line reaches its field, typed."""
    from diffusion_extras.training import config as config_module
    cli_fields = [f for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert {o for o in options if not o.startswith("--no-")} - {"-h", "--help", "--config"} == \
        {f"--{f.name}" for f in cli_fields}
    # validation is not under test here: every field at once at a non-default value is no sensible run
    monkeypatch.setattr(config_module, "validate", lambda config: None)
    parsed = parse_config([flag for f in cli_fields for flag in non_default(f)[1]])
    for f in cli_fields:
        value = getattr(parsed, f.name)
        assert value == non_default(f)[0] and type(value) is type(non_default(f)[0]), f.name


def test_num_epochs_alone_sets_the_length_and_steps_win_when_both(tmp_path):
    assert parse_config(["--num_epochs", "3"]).max_train_steps is None
    assert parse_config(["--num_epochs", "3", "--max_train_steps", "7"]).max_train_steps == 7
    path = tmp_path / "r.yaml"
    path.write_text("num_epochs: 2\n")
    assert parse_config(["--config", str(path)]).max_train_steps is None
    assert parse_config(["--config", str(path), "--max_train_steps", "5"]).max_train_steps == 5


def test_zero_terminal_snr_flag_reaches_the_scheduler():
    scheduler = models.build_noise_scheduler(parse_config(["--rescale_betas_zero_snr", "--prediction_type",
                                                           "v_prediction"]))
    assert scheduler.alphas_cumprod[-1].item() == 0.0 and scheduler.config.prediction_type == "v_prediction"
    assert models.build_noise_scheduler(parse_config([])).alphas_cumprod[-1].item() > 0


def test_unknown_yaml_key_and_bad_types(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("learnig_rate: 1e-4\n")
    with pytest.raises(ConfigError, match="unknown setting.*learnig_rate"):
        parse_config(["--config", str(path)])
    path.write_text("train_batch_size: 2.5\n")
    with pytest.raises(ConfigError, match="train_batch_size: expected int"):
        parse_config(["--config", str(path)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("flags,message", [
    (["--eval_batch_size", "0"], "--eval_batch_size must be at least 1"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be at least 1"),
    (["--max_train_steps", "0"], "--max_train_steps must be at least 1"),
    (["--save_images_steps=-1"], "--save_images_steps must be at least 0"),
    (["--lr_scheduler", "step"], "--lr_scheduler 'step' is not one of"),
    (["--prediction_type", "noise"], "--prediction_type 'noise' is not one of"),
    (["--ema_max_decay", "1.0"], "--ema_max_decay must lie in (0, 1)"),
    (["--max_grad_norm", "-1"], "--max_grad_norm must be >= 0"),
    (["--snr_gamma=-1"], "--snr_gamma must be >= 0"),
    (["--loss_type", "l1"], "--loss_type 'l1' is not one of"),
    (["--dataset_name", "a", "--train_data_dir", "."], "not both"),
    (["--model_config_name_or_path", "/no/such/unet"], "UNet config folder or file /no/such/unet does not exist"),
    (["--resolution", "30"], "--resolution 30 cannot be halved 2 times"),
])
def test_validation_messages(flags, message):
    with pytest.raises(ConfigError) as error:
        parse_config(flags)
    assert message in str(error.value)


@pytest.mark.parametrize("given,resolution", [
    ("16", 16), ("8,16", (8, 16)), ("8x16", (8, 16)), ("8X16", (8, 16)), (" 8 , 16 ", (8, 16)),
    ("16,16", 16), ("16x16", 16),  # a square pair is N: a square run stores and exports what it did
])
def test_resolution_is_n_or_height_and_width(given, resolution):
    assert parse_config(["--resolution", given]).resolution == resolution


@pytest.mark.parametrize("value,resolution", [(16, 16), (16.0, 16), ([8, 16], (8, 16)), ("8x16", (8, 16)),
                                              ("8,16", (8, 16)), ([12, 12], 12)])
def test_a_recipe_gives_the_resolution_as_n_a_list_or_text(tmp_path, value, resolution):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"resolution": value}))
    assert parse_config(["--config", str(path)]).resolution == resolution


@pytest.mark.parametrize("given,message", [
    ("abc", "--resolution 'abc' is not a size: give N (square), H,W or HxW in pixels, height first"),
    ("8,16,4", "--resolution '8,16,4' is not a size"),
    ("8.5", "--resolution '8.5' is not a size"),
    ("8x", "--resolution '8x' is not a size"),
    ("0", "--resolution 0: each side must be at least 1 pixel"),
    ("8x0", "--resolution 8x0: each side must be at least 1 pixel"),
    # the digits UNet halves twice: each side a multiple of 4, the message names the side
    ("32,30", "--resolution 32x30: its width 30 cannot be halved 2 times by the UNet's 3 blocks; use a multiple "
              "of 4 (e.g. 28)"),
    ("18x32", "--resolution 18x32: its height 18 cannot be halved 2 times"),
])
def test_a_bad_resolution_is_one_line_naming_the_fix(given, message):
    with pytest.raises(ConfigError) as error:
        parse_config(["--resolution", given])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_model_config_from_json_file_and_pipeline_folder(tmp_path):
    unet = tiny_unet()  # block_out_channels (8, 16), checked below
    unet.save_config(str(tmp_path / "pipe" / "unet"))
    for path in (tmp_path / "pipe", tmp_path / "pipe" / "unet", tmp_path / "pipe" / "unet" / "config.json"):
        config = parse_config(["--model_config_name_or_path", str(path), "--resolution", "12"])
        built = models.build_unet(config)
        assert list(built.config.block_out_channels) == [8, 16] and built.config.sample_size == 12


@pytest.mark.usefixtures("fresh_accelerate")
def test_a_model_config_without_channels_gets_diffusers_defaults_with_or_without_a_condition(tmp_path):
    """A --model_config_name_or_path JSON that leaves out in_channels and out_channels means diffusers'
    UNet2DModel defaults (3, RGB), as diffusers' train_unconditional.py builds it: the condition's
    channels are added to those, and the grayscale digits are read as RGB to train it (one step)."""
    import json

    from helpers import TINY_RECIPE, first_step_inputs

    shape = {k: v for k, v in TINY_RECIPE["model"].items() if k not in ("in_channels", "out_channels")}
    path = tmp_path / "unet.json"
    path.write_text(json.dumps(shape))
    for kind, inputs in (("none", 3), ("super_resolution", 6), ("inpainting", 7)):
        built = models.build_unet(parse_config(["--model_config_name_or_path", str(path), "--resolution", "8",
                                                "--conditioning", kind]))
        assert (built.config.in_channels, built.config.out_channels) == (inputs, 3), kind
    cleans, seen = first_step_inputs(tmp_path, "--model_config_name_or_path", path, "--conditioning",
                                     "super_resolution", "--sr_factor", 2)
    assert cleans[0].shape[1] == 3 and seen[0].shape[1] == 6


def test_model_config_from_a_hub_id_as_diffusers_reads_it(tmp_path, monkeypatch):
    """diffusers' train_unconditional.py reads --model_config_name_or_path with load_config: a Hub
    id of a UNet repo works there, so here (a pipeline repo's unet/ too)."""
    from hub_server import HubServer, serve_in_process
    tiny_unet().save_config(str(tmp_path / "unet_repo"))
    tiny_unet().save_config(str(tmp_path / "pipeline_repo" / "unet"))
    with HubServer() as server:
        server.add_repo("someone/unet", str(tmp_path / "unet_repo"))
        server.add_repo("someone/pipeline", str(tmp_path / "pipeline_repo"))
        serve_in_process(monkeypatch, server, tmp_path / "hub_cache")
        for repo_id in ("someone/unet", "someone/pipeline"):
            built = models.build_unet(parse_config(["--model_config_name_or_path", repo_id, "--resolution", "12"]))
            assert list(built.config.block_out_channels) == [8, 16] and built.config.sample_size == 12
        with pytest.raises(ConfigError, match="someone/missing: no UNet2DModel config.json there"):
            models.build_unet(parse_config(["--model_config_name_or_path", "someone/missing"]))


def test_abbreviated_flags_are_refused():
    """--hub_tok=... must not reach hub_token unnoticed (and then the command line, via trackers)."""
    with pytest.raises(SystemExit):
        parse_config(["--hub_tok=hf_abbreviated"])


def test_secrets_are_scrubbed_from_argv_by_value():
    from diffusion_extras.hub.secrets import redact_argv
    argv = ["train_ddpm.py", "--hub_token", "hf_abc123", "--hub_token=hf_abc123", "--output_dir", "x"]
    redact_argv(argv, ["hf_abc123", None])
    assert argv == ["train_ddpm.py", "--hub_token", "***", "--hub_token=***", "--output_dir", "x"]


def test_saved_config_never_holds_tokens(tmp_path):
    config = TrainConfig()
    config.__dict__["hub_token"] = "hf_secret_value"  # whatever secret settings exist, by name
    save_config(config, str(tmp_path / "c.yaml"))
    text = (tmp_path / "c.yaml").read_text()
    assert "hf_secret_value" not in text and "hub_token" not in text
    assert yaml.safe_load(text)["learning_rate"] == config.learning_rate


# ------------------------------------------------------------------ flag groups
def group_index(name: str) -> int:
    from diffusion_extras.training.config import GROUPS
    return GROUPS.index({f.name: f for f in dataclasses.fields(TrainConfig)}[name].metadata["group"])


def test_every_field_has_a_group_and_fields_are_declared_group_by_group():
    from diffusion_extras.training.config import GROUP_DESCRIPTIONS, GROUPS
    assert tuple(GROUP_DESCRIPTIONS) == GROUPS and all(GROUP_DESCRIPTIONS.values())
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert all(f.metadata.get("group") in GROUPS for f in dataclasses.fields(TrainConfig))
    indices = [group_index(name) for name in names]
    assert indices == sorted(indices), "TrainConfig's fields must be declared in GROUPS order"
    assert set(indices) == set(range(len(GROUPS))), "a declared group has no field"


def test_help_shows_each_flag_under_its_group_in_group_order():
    import re

    from diffusion_extras.training.config import GROUPS, config_fields
    text = build_parser().format_help()
    headings = [text.index(f"\n{group}:\n") for group in GROUPS]  # argparse: "title:" on its own line
    assert headings == sorted(headings), "the groups appear in GROUPS order"
    bounds = dict(zip(GROUPS, zip(headings, headings[1:] + [len(text)])))
    for f in config_fields():
        flag = re.search(rf"^  --{f.name}\b", text, re.MULTILINE)
        assert flag, f.name
        start, end = bounds[f.metadata["group"]]
        assert start < flag.start() < end, f"--{f.name} is not under {f.metadata['group']}"


def test_saved_config_lists_settings_in_group_order(tmp_path):
    """training_config.yaml (from the resolved config the run saves) follows the --help order."""
    from diffusion_extras.training.run_state import Plan, optimization_values
    plan = Plan(max_train_steps=5, save_images_steps=5, save_model_steps=5, model={}, validation_split=0.0,
                grad_diagnostics_steps=0, **optimization_values(TrainConfig(), {}))
    for config in (TrainConfig(), plan.resolved_config(TrainConfig())):
        save_config(config, str(tmp_path / "c.yaml"))
        keys = list(yaml.safe_load((tmp_path / "c.yaml").read_text()))  # safe_load keeps the file's order
        assert keys == [f.name for f in dataclasses.fields(TrainConfig) if f.name != "hub_token"]
        assert [group_index(k) for k in keys] == sorted(group_index(k) for k in keys)
