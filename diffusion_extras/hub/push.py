"""Hub push and model card: push only the pipeline (never optimizer/RNG state), in the background.

`HubPusher.push` snapshots the pipeline files of the output folder into a staging directory and
uploads the snapshot, so training can overwrite the folder (next save) while an upload is running.
Pushes never overlap: a push first waits for the previous one. huggingface_hub retries transient
HTTP errors itself; a push that still fails is re-raised by the next `push` or by `wait`.
"""

import os
import shutil
import tempfile
from concurrent.futures import Future

from huggingface_hub import HfApi, ModelCard, ModelCardData, constants, get_token
from huggingface_hub.utils import HFValidationError, filter_repo_objects, validate_repo_id

# torch-free: the pipeline module itself would import torch and diffusers (seconds) for two constants
from diffusion_extras.evaluation.choices import (
    DEFAULT_GUIDANCE_SCALE,
    DEFAULT_NOISE_LEVEL,
    DIT_PIPELINE_MODULE,
    IMAGE_PIPELINE_MODULE,
    PIPELINE_MODULE,
)
from diffusion_extras.hub.secrets import redact_config  # the project's one secret-dropping rule

# What a DDPMPipeline needs, plus its card; everything else in the output dir stays local. The
# custom pipelines add their source files (class-conditional, latent: model_index.json names one, the
# Hub loads it as remote code with its relative imports), a latent pipeline its VAE, and a pipeline
# with an autoguidance guide its guide/ (model_index.json names that too).
PIPELINE_PATTERNS = ["model_index.json", "unet/*", "transformer/*", "scheduler/*", "vae/*", "guide/*", "README.md",
                     "images/*", "training_config.yaml", "pipeline_*.py"]
# Training state that must never leave the machine even if it lands inside an allowed folder.
NEVER_PUSH_PATTERNS = ["*.pkl", "*optimizer*.bin", "*random_states*", "*.lock"]
CARD_IMAGES_DIR = "images"  # card images live here, the only image folder that is pushed
SECRET_SCAN_MAX_BYTES = 16 * 1024 * 1024  # weights are bigger and are not scanned for the token
CARD_TAGS = ["pytorch", "diffusers", "unconditional-image-generation", "ddpm"]


def resolve_token(hub_token: str | None) -> str:
    """The given token, else the logged-in one (HF_TOKEN, then the token file under HF_HOME)."""
    token = hub_token or get_token()
    if not token:
        raise ValueError(
            "--push_to_hub needs a token: pass --hub_token or run `hf auth login` "
            "(or set HF_TOKEN) before training"
        )
    return token


def default_repo_id(output_dir: str, hub_model_id: str | None) -> str:
    """`hub_model_id` if given, else the output dir's basename (the Hub adds the user namespace)."""
    repo_id = hub_model_id or os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(
            f"'{repo_id}' is not a valid Hub repo id ({err}); pass --hub_model_id name or namespace/name"
        ) from None
    return repo_id


def refuse_offline() -> None:
    if constants.is_offline_mode():  # read once, when huggingface_hub is imported
        raise ValueError("--push_to_hub cannot work in offline mode: unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE)")


def check_push(hub_token: str | None, output_dir: str, hub_model_id: str | None) -> tuple[str, str]:
    """(token, repo id): what a push needs that the network is not asked for, online mode included;
    raises ValueError naming the fix. The trainer asks before importing its stack (seconds), and
    again when it creates the repo (training.artifacts.connect_hub)."""
    token = resolve_token(hub_token)
    repo_id = default_repo_id(output_dir, hub_model_id)
    refuse_offline()
    return token, repo_id


class HubPusher:
    """Creates the Hub repo up front (so bad tokens or names fail before training) and pushes the
    pipeline files of `folder` to it, one commit per push."""

    def __init__(self, repo_id: str, token: str, private: bool, folder: str):
        refuse_offline()
        self.token, self.folder = token, folder
        self.api = HfApi(token=token)
        # The Hub ignores `private` for a repo that already exists: its visibility is kept.
        repo_url = self.api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        self.repo_id = repo_url.repo_id  # with the namespace the Hub filled in
        self.url = str(repo_url)
        self._pending: Future | None = None
        self._last_commit_url: str | None = None

    def push(self, commit_message: str, blocking: bool = False) -> None:
        self.wait()  # one commit at a time; surfaces a failed background push here
        staging = self._stage()
        if blocking:
            self._last_commit_url = self._upload(staging, commit_message)
        else:
            # HfApi.run_as_future runs jobs on one worker thread, in submission order.
            self._pending = self.api.run_as_future(self._upload, staging, commit_message)

    def wait(self) -> str | None:
        """Waits for the pending push, re-raises its error, returns the last commit URL."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._last_commit_url = pending.result()
        return self._last_commit_url

    def pipeline_files(self) -> list[str]:
        """Paths (relative, '/'-separated) of the files `push` would upload from `folder`."""
        paths = []
        for root, _, names in os.walk(self.folder):
            rel_root = os.path.relpath(root, self.folder)
            paths += [name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/") for name in names]
        return sorted(filter_repo_objects(paths, allow_patterns=PIPELINE_PATTERNS, ignore_patterns=NEVER_PUSH_PATTERNS))

    def _stage(self) -> str:
        paths = self.pipeline_files()
        if "model_index.json" not in paths:
            raise ValueError(
                f"nothing to push: {self.folder} has no model_index.json; save the pipeline "
                "(pipeline.save_pretrained) before pushing"
            )
        staging = tempfile.mkdtemp(prefix="hub-push-")
        try:
            for path in paths:
                src, dst = os.path.join(self.folder, path), os.path.join(staging, path)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(src, dst)
                self._refuse_if_secret(dst, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def _refuse_if_secret(self, file_path: str, path_in_repo: str) -> None:
        # Last line of defense: a config or card that captured the token must not be published.
        if os.path.getsize(file_path) > SECRET_SCAN_MAX_BYTES:
            return
        with open(file_path, "rb") as f:
            if self.token.encode() in f.read():
                raise ValueError(
                    f"refusing to push {path_in_repo}: it contains the Hub token; "
                    "write it through redact_config / write_model_card"
                )

    def _upload(self, staging: str, commit_message: str) -> str:
        try:
            commit = self.api.upload_folder(
                repo_id=self.repo_id, folder_path=staging, commit_message=commit_message, repo_type="model"
            )
            return commit.commit_url
        except Exception as err:
            err.add_note(f"while pushing '{commit_message}' from {self.folder} to {self.repo_id}")
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def write_model_card(folder: str, info: dict) -> str:
    """Writes folder/README.md for a DDPM pipeline and returns its path. `info` keys: repo_id,
    config (dict), global_step, images_seen, metrics (dict), sample_grid and loss_plot (paths under
    folder/images/), dataset_name, license, title, class_names (a class-conditional pipeline), _redact
    (secrets to keep out of the card), base_model (the pipeline a fine-tune started from: named in
    the text, and in the metadata's `base_model` when it is a Hub id), vae (a latent pipeline: the
    autoencoder it was trained with) and vae_class (its class; default AutoencoderKL),
    latent_normalization (how its latents were: "normalised by ..."), conditioning (an
    image-conditioned pipeline: {"conditioning": kind, "sr_factor": n})."""
    secrets = [s for s in info.get("_redact") or [] if s]
    config = redact_config(info.get("config") or {}, secrets)
    repo_id = info.get("repo_id") or default_repo_id(folder, None)
    dataset = info.get("dataset_name") or config.get("dataset_name")
    card_data = ModelCardData(
        library_name="diffusers",
        pipeline_tag="image-to-image" if info.get("conditioning") else "unconditional-image-generation",
        tags=CARD_TAGS + (["class-conditional"] if info.get("class_names") else [])
        + (["latent-diffusion"] if info.get("vae") else [])
        + ([info["conditioning"]["conditioning"].replace("_", "-")] if info.get("conditioning") else []),
        datasets=[dataset] if _is_hub_id(dataset) else None,
        base_model=info.get("base_model") if _is_hub_id(info.get("base_model")) else None,
        license=info.get("license") or "apache-2.0",
    )
    body = _card_body(folder, info, config, repo_id, dataset)
    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}")
    if any(s in str(card) for s in secrets):
        raise ValueError("refusing to write the model card: it would contain a secret passed in info['_redact']")
    path = os.path.join(folder, "README.md")
    card.save(path)
    return path


def _is_hub_id(name: str | None) -> bool:
    if not name or os.path.exists(name):
        return False  # a local folder, not a Hub repo
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _card_body(folder: str, info: dict, config: dict, repo_id: str, dataset: str | None) -> str:
    flow = config.get("objective") == "flow_matching"
    title = info.get("title") or f"{'Flow matching' if flow else 'DDPM'}: {repo_id.split('/')[-1]}"
    trained_on = f" on `{dataset}`" if dataset else ""
    conditioning = info.get("conditioning")
    kind = (IMAGE_MODEL_KINDS[conditioning["conditioning"]].format(**conditioning) if conditioning
            else "An unconditional image-generation model")
    backbone = BACKBONES[config.get("model_type") or "unet"]
    lines = [
        f"# {title}", "",
        f"{kind}: {backbone} trained {FLOW_TEXT.format(shift=config.get('flow_shift', 1.0)) if flow else DDPM_TEXT}"
        f"{trained_on} with `train_ddpm.py`.", "",
        "## Training recipe", "",
    ]
    if info.get("base_model"):
        lines += [f"Fine-tuned from `{info['base_model']}`.", ""]
    if info.get("vae"):
        autoencoder = info.get("vae_class") or "AutoencoderKL"
        lines += [f"Latent diffusion: the UNet was trained on the latents of the {autoencoder} `{info['vae']}`, "
                  "saved in `vae/`, which decodes its samples."
                  + (f" Its latents were {info['latent_normalization']}." if info.get("latent_normalization")
                     else ""), ""]
    if "global_step" in info or "images_seen" in info:
        lines += [f"Trained for {info.get('global_step', '?')} optimizer steps "
                  f"({info.get('images_seen', '?')} training images seen).", ""]
    lines += _table(("hyperparameter", "value"), config.items(), str)  # full precision: 0.99995 stays
    if info.get("metrics"):
        lines += ["## Evaluation", ""] + _table(("metric", "value"), info["metrics"].items(), _metric_text)
    for key, heading in (("sample_grid", "Samples"), ("loss_plot", "Loss per timestep")):
        if info.get(key):
            lines += [f"## {heading}", "", f"![{heading}]({_card_image(folder, info[key], key)})", ""]
    if conditioning:
        lines += _image_usage(repo_id, conditioning, info.get("vae") is not None)
    else:
        # a run trained with --condition_dropout 0 has no no-class prediction: its pipeline refuses guidance
        guided = config.get("condition_dropout") != 0
        lines += (_latent_usage(repo_id, info.get("class_names")) if info.get("vae")
                  else _usage(repo_id, info.get("class_names"), guided, config.get("model_type") == "dit"))
    return "\n".join(lines)


# The card's first sentence: the backbone (--model_type) and how it was trained (--objective)
BACKBONES = {"unet": "a UNet",
             "dit": "a diffusion transformer (DiT, [Peebles & Xie, 2023](https://arxiv.org/abs/2212.09748))"}
DDPM_TEXT = "as a denoising diffusion probabilistic model ([Ho et al., 2020](https://arxiv.org/abs/2006.11239))"
FLOW_TEXT = ("by flow matching ([Lipman et al., 2023](https://arxiv.org/abs/2210.02747); rectified flow, "
             "[Liu et al., 2023](https://arxiv.org/abs/2209.03003)): it predicts the velocity noise - x_0 and "
             "samples with diffusers' `FlowMatchEulerDiscreteScheduler` (shift {shift:g}), or a flow-capable "
             "scheduler swapped in")


# What an image-conditioned model does, by --conditioning (the card's first sentence)
IMAGE_MODEL_KINDS = {"super_resolution": "A {sr_factor}x super-resolution model (SR3-style: the low-resolution image, "
                                         "upsampled, is given to the UNet beside x_t)",
                     "inpainting": "An inpainting model (the mask and the masked image are given to the UNet beside "
                                   "x_t, as in Stable Diffusion inpainting)",
                     "image": "An image-to-image model (the conditioning image is given to the UNet beside x_t, "
                              "as in Palette)"}
IMAGE_CALLS = {"super_resolution": ('low_resolution = Image.open("low_resolution.png")',
                                    "image=low_resolution"),
               "inpainting": ('image, mask = Image.open("image.png"), Image.open("mask.png")  # mask: white = to fill',
                              "image=image, mask_image=mask"),
               "image": ('condition = Image.open("condition.png")', "image=condition")}


def _image_usage(repo_id: str, conditioning: dict, latent: bool) -> list[str]:
    """An image-conditioned pipeline's usage (`conditioning`: its pipeline_config): its call with PIL
    images (numpy arrays and tensors work too), and the noise level of one trained with conditioning
    augmentation."""
    opened, arguments = IMAGE_CALLS[conditioning["conditioning"]]
    augmented = conditioning.get("max_noise_level") or 0
    if augmented:
        arguments += f", noise_level={DEFAULT_NOISE_LEVEL}"
    return ["## Usage", "",
            f"The pipeline's code is `{IMAGE_PIPELINE_MODULE}.py` in this repository, with the files it imports "
            "(hence `trust_remote_code=True`)" + ("; its VAE is in `vae/`" if latent else "") + ".", "",
            *([f"Trained with conditioning augmentation: its inputs were noised to levels 0 to {augmented} and the "
               f"model told the level. `noise_level` (0 to {augmented}, default {DEFAULT_NOISE_LEVEL}) is the level "
               "an input is given at: raise it for noisy, compressed or otherwise degraded inputs.", ""]
              if augmented else []),
            "```python", "import torch", "from diffusers import DiffusionPipeline", "from PIL import Image", "",
            f'pipeline = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)', opened,
            f"images = pipeline({arguments}, num_inference_steps=50, generator=torch.manual_seed(0)).images",
            'images[0].save("result.png")', "```", ""]


def _latent_usage(repo_id: str, class_names: list | None) -> list[str]:
    """A latent pipeline's usage: decoded images, unconditional or by class, and its latents."""
    call = ("class_labels=pipeline.get_label_ids([" + ", ".join(f'"{name}"' for name in class_names[:2]) + "])"
            if class_names else "batch_size=2")
    return ["## Usage", "",
            "The pipeline's code is `pipeline_latent.py` in this repository, with `pipeline_class_conditional.py` "
            "whose guidance it shares (hence `trust_remote_code=True`).", "",
            "```python", "import torch", "from diffusers import DiffusionPipeline", "",
            f'pipeline = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)',
            f"images = pipeline({call}, num_inference_steps=50, generator=torch.manual_seed(0)).images",
            'images[0].save("sample.png")',
            f'latents = pipeline({call}, num_inference_steps=50, output_type="latent").images  # not decoded',
            "```", ""]


def _usage(repo_id: str, class_names: list | None, guided: bool = True, dit: bool = False) -> list[str]:
    """A DDPMPipeline's usage, or a class-conditional one's: with guidance where the run trained the
    no-class prediction (`guided`), else without (the pipeline refuses guidance_scale != 1 then); a
    DiT's (`dit`) through its own pipeline file, with classes or without."""
    module = DIT_PIPELINE_MODULE if dit else PIPELINE_MODULE
    if dit and not class_names:
        return ["## Usage", "",
                f"The pipeline's code is `{module}.py` in this repository (hence `trust_remote_code=True`).", "",
                "```python", "import torch", "from diffusers import DiffusionPipeline", "",
                f'pipeline = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)',
                "image = pipeline(num_inference_steps=50, generator=torch.manual_seed(0)).images[0]",
                'image.save("sample.png")', "```", ""]
    if not class_names:
        return ["## Usage", "", "```python", "from diffusers import DDPMPipeline", "",
                f'pipeline = DDPMPipeline.from_pretrained("{repo_id}")',
                "image = pipeline(batch_size=1).images[0]", 'image.save("sample.png")', "```", ""]
    names = ", ".join(f'"{name}"' for name in class_names[:2])
    return ["## Usage", "",
            f"Class-conditional: {len(class_names)} classes ({', '.join(map(str, class_names[:10]))}"
            f"{', ...' if len(class_names) > 10 else ''}), sampled with classifier-free guidance. The pipeline's code "
            f"is `{module}.py` in this repository (hence `trust_remote_code=True`).", "",
            "```python", "import torch", "from diffusers import DiffusionPipeline", "",
            f'pipeline = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)',
            f"class_ids = pipeline.get_label_ids([{names}])  # pipeline.id2label lists the classes",
            f"images = pipeline(class_labels=class_ids, guidance_scale={DEFAULT_GUIDANCE_SCALE if guided else 1.0},",
            "                  num_inference_steps=50, generator=torch.manual_seed(0)).images",
            'images[0].save("sample.png")', "```", "",
            "`guidance_interval=(low, high)` guides only at noise levels sigma in (low, high] (Kynkäänniemi et al. "
            "2024; one model call elsewhere)" + (
                "." if dit else ", and a weaker UNet set as `pipeline.guide` guides in place of the no-class branch "
                "(autoguidance, Karras et al. 2024; saved in `guide/`, off with `autoguidance=False`).")
            if guided else "Trained with `--condition_dropout 0`: there is no no-class prediction to guide with, so "
            "the pipeline samples without classifier-free guidance (it refuses `guidance_scale` other than 1).",
            ""]


def _card_image(folder: str, path: str, key: str) -> str:
    # Relative links render on the Hub only for files that are pushed, i.e. under images/.
    rel = path.replace(os.sep, "/")
    if os.path.isabs(path) or not rel.startswith(f"{CARD_IMAGES_DIR}/") or ".." in rel.split("/"):
        raise ValueError(f"info['{key}'] = {path!r}: give a path relative to the output dir under {CARD_IMAGES_DIR}/")
    if not os.path.isfile(os.path.join(folder, rel)):
        raise ValueError(f"info['{key}'] = {path!r}: no such file in {folder}; save the image before the card")
    return rel


def _metric_text(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(header: tuple[str, str], rows, text) -> list[str]:
    def cell(value) -> str:
        return text(value).replace("|", "\\|").replace("\n", " ")

    rows = list(rows)
    if not rows:
        return []
    return [f"| {header[0]} | {header[1]} |", "| --- | --- |"] + [f"| {cell(k)} | {cell(v)} |" for k, v in rows] + [""]
