"""DiT (Peebles & Xie 2023) as the run's model: diffusers' DiTTransformer2DModel by the paper's size
names (--dit_size), from a config file, or a size that follows the data; its own label dropout off."""
from __future__ import annotations

from diffusion_extras.core import vlb
from diffusion_extras.core.choices import DIT_SHAPES
from diffusion_extras.data.spec import image_size, resolution_text
from diffusion_extras.training.config import ConfigError, TrainConfig
from diffusion_extras.training.models import Choice, load_unet_config

# With no --dit_size: images of at most 32 px a side get a DiT that the digits (16 px) train on a
# 2-core CPU in minutes, the width and depth of a small ViT (depth 6, width 128, 4 heads of 32:
# ~1.7M parameters with one class); larger ones DiT-S. The patch is the smallest of 2, 4, 8 that
# leaves at most 16 x 16 tokens (DiT's 256 px ImageNet model sees 32 x 32 latents as 16 x 16
# patches of 2), so the attention's cost stays that of 256 tokens at any size up to 128 px.
SMALL_DIT = (6, 128, 4)            # (depth, hidden size, heads)
SMALL_DIT_MAX_SIDE = 32            # px: the largest side that gets SMALL_DIT
MAX_TOKENS_A_SIDE = 16
# DiT's own Hub repositories (facebook/DiT-XL-2-256, -512) store their transformer's config in the
# older Transformer2DModel form (written by diffusers 0.12): patched input, ada_norm_zero, a label
# table, and fields of other transformers (cross_attention_dim, num_vector_embeds, ...) unset.
# diffusers builds that form as a DiTTransformer2DModel, with the same weight names.
LEGACY_DIT_FORM = {"norm_type": "ada_norm_zero", "cross_attention_dim": None, "num_vector_embeds": None}


def dit_shape(config: TrainConfig, side: int) -> tuple[tuple[int, int, int], int, str]:
    """((depth, hidden size, heads), patch size, how it was chosen) for images of `side` px."""
    if config.dit_size:
        name, patch = config.dit_size.split("/")
        return DIT_SHAPES[name], int(patch), f"DiT-{config.dit_size}"
    patch = next((patch for patch in (2, 4, 8) if side // patch <= MAX_TOKENS_A_SIDE), 8)
    if side <= SMALL_DIT_MAX_SIDE:
        return SMALL_DIT, patch, f"a small DiT for {side} px images (no --dit_size chosen)"
    return DIT_SHAPES["S"], patch, f"DiT-S/{patch} for {side} px images (no --dit_size chosen)"


def follow_data(config: TrainConfig, data_channels: int, class_names: list | None = None, latent=None) -> Choice:
    """The DiT for this run: --model_config_name_or_path's, or --dit_size's, or one that follows the
    data (dit_shape), with the images' channels (2C outputs with a learned variance), their size, and
    num_embeds_ada_norm = the number of classes (1 unconditional: DiT always takes a label, and an
    unconditional one is given its "no class" index, num_embeds_ada_norm). In a `latent` space (a
    LatentSpace) the data are the latents: their channels and side, as DiT's own 256 px models see
    32 x 32 x 4 latents."""
    side = image_size(config.resolution)[0]  # square: validation refused any other
    if latent is not None:
        data_channels, side = latent.channels, image_size(latent.size)[0]
    classes = len(class_names) if class_names is not None else 1
    outputs = vlb.output_channels(data_channels, config.variance_type)
    if config.model_config_name_or_path:
        values = dit_config_file(config.model_config_name_or_path)
        description = f"DiT from {config.model_config_name_or_path}"
    else:
        (depth, hidden, heads), patch, description = dit_shape(config, side)
        values = dict(num_layers=depth, num_attention_heads=heads, attention_head_dim=hidden // heads,
                      patch_size=patch)
    values.update(in_channels=data_channels, out_channels=outputs, sample_size=side, num_embeds_ada_norm=classes)
    if side % values["patch_size"]:
        what = f"its {side}x{side} latents are" if latent is not None else "it is"
        raise ConfigError(f"--resolution {resolution_text(config.resolution)}: {what} not a multiple of the DiT's "
                          f"patch size {values['patch_size']}: use a multiple of it, or a smaller patch (--dit_size)")
    if class_names is not None:
        description += f", conditioned on {len(class_names)} classes"
    return Choice(values, {}, description)


def dit_config_file(name: str) -> dict:
    """A DiTTransformer2DModel's keyword arguments from --model_config_name_or_path (as
    load_unet_config reads it; either form of a DiT's config); any other model's is refused by name."""
    values = load_unet_config(name)
    kwargs = pretrained_kwargs(values)
    if kwargs is None:
        raise ConfigError(f"--model_config_name_or_path {name}: a {values.get('_class_name')} config, and "
                          "--model_type dit builds a DiTTransformer2DModel: give a DiT's config, or --model_type unet")
    return kwargs


def pretrained_kwargs(values: dict) -> dict | None:
    """What DiTTransformer2DModel takes of a DiT's config (a config.json's values): a
    DiTTransformer2DModel's, or the older Transformer2DModel form (LEGACY_DIT_FORM, with a patch size
    and a label table), its other transformers' fields dropped. None for any other model's config."""
    import inspect

    from diffusers import DiTTransformer2DModel

    name = values.get("_class_name")
    legacy = (name == "Transformer2DModel" and values.get("patch_size") is not None
              and values.get("num_embeds_ada_norm") is not None
              and all(values.get(key) == value for key, value in LEGACY_DIT_FORM.items()))
    if name != "DiTTransformer2DModel" and not legacy:
        return None
    accepted = inspect.signature(DiTTransformer2DModel.__init__).parameters
    return {key: value for key, value in values.items() if key in accepted and key != "self"}


def fit_classes(flag: str, model: dict, class_names: list | None) -> dict:
    """A pretrained DiT's keyword arguments for this run's classes (1 unconditional, as follow_data's):
    a DiT takes any classes, its label tables refitted as the weights load (load_pretrained)."""
    return {**model, "num_embeds_ada_norm": len(class_names) if class_names is not None else 1}


def load_pretrained(source: str, subfolder: str | None, model: dict, with_weights: bool):
    """The DiT of `model` kwargs (fit_classes'), with the pretrained DiT's weights at `source`
    (from_pretrained: a Hub id or a folder) when `with_weights`, its label tables fitted
    (fitted_label_tables); its label dropout off."""
    from diffusers import DiTTransformer2DModel

    built = build_dit(None, model)
    if with_weights:
        weights = DiTTransformer2DModel.from_pretrained(source, subfolder=subfolder).state_dict()
        built.load_state_dict(fitted_label_tables(weights, model["num_embeds_ada_norm"]))
    return built


def fitted_label_tables(weights: dict, classes: int) -> dict:
    """A DiT's `weights` with each block's label table (classes + 1 rows, the last "no class") made
    for `classes` classes. A table of that size is kept: the base's classes are the data's, by index.
    Any other becomes `classes` copies of the base's "no class" row and that row itself, last: each
    class starts where the base's unconditional model is (guidance too has its "no class" from the
    first step), and training moves it; no random rows, so nothing is drawn outside the seed rule."""
    fitted = dict(weights)
    for key, table in weights.items():
        if key.endswith("class_embedder.embedding_table.weight") and len(table) != classes + 1:
            fitted[key] = table[-1:].repeat(classes + 1, 1)
    return fitted


def build_dit(config: TrainConfig | None, model: dict, latent=None):
    """The DiTTransformer2DModel of `model` kwargs (follow_data's, or a pretrained DiT's), with its
    label dropout off."""
    from diffusers import DiTTransformer2DModel

    try:
        return without_label_dropout(DiTTransformer2DModel(**model))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the DiT config is invalid: {error}") from None


def without_label_dropout(model):
    """`model` with its class-label dropout off, in place. diffusers builds each block's label
    embedding with class_dropout_prob 0.1 (CombinedTimestepLabelEmbeddings' default; LabelEmbedding
    keeps the "no class" row for any dropout_prob > 0 at construction), and drops labels in training
    mode with torch.rand of the global RNG: a draw per block and step outside the (seed, micro-step)
    rule, on top of the trainer's own --condition_dropout. The row stays; the drop goes."""
    from diffusers.models.embeddings import LabelEmbedding

    for module in model.modules():
        if isinstance(module, LabelEmbedding):
            module.dropout_prob = 0.0
    return model


def architecture(config) -> str:
    """The model line's shape: depth, width, heads, patch and tokens."""
    tokens = config.sample_size // config.patch_size
    return (f"DiT depth {config.num_layers}, width {config.num_attention_heads * config.attention_head_dim}, "
            f"{config.num_attention_heads} heads, patch {config.patch_size} ({tokens}x{tokens} tokens)")
