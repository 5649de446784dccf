"""The backbone seam (evaluation/pipeline_backbone.py) with the UNet: predict is the UNet's own call,
a class-conditional UNet without labels gives its "no class" prediction, a wrapped model is asked
through its module, and any other model is called as a UNet. (The DiT's side: tests/test_dit.py.)"""
from types import SimpleNamespace

import torch
from helpers import tiny_unet

from diffusion_extras.evaluation.pipeline_backbone import (
    DiTBackbone,
    UNetBackbone,
    backbone_of,
    null_class,
    predict,
    sample_shape,
)


def test_predict_is_the_unets_call_and_no_labels_its_no_class():
    unet = tiny_unet(num_class_embeds=4).eval()
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([5, 50, 500])
    with torch.no_grad():
        labelled = unet(x, t, class_labels=torch.tensor([0, 1, 2])).sample
        no_class = unet(x, t, class_labels=torch.tensor([3, 3, 3])).sample
        assert torch.equal(predict(unet, x, t, torch.tensor([0, 1, 2])), labelled)
        assert torch.equal(predict(unet, x, t), no_class)
    assert null_class(unet) == 3 and null_class(tiny_unet()) is None and sample_shape(unet) == (1, 8, 8)


def test_a_wrapped_model_is_asked_through_its_module_and_any_other_is_a_unet():
    from diffusers import DiTTransformer2DModel
    dit = DiTTransformer2DModel(num_layers=1, num_attention_heads=2, attention_head_dim=8, in_channels=1,
                                sample_size=8, num_embeds_ada_norm=2)
    assert backbone_of(SimpleNamespace(module=dit)) is DiTBackbone  # as DDP wraps it
    assert backbone_of(tiny_unet()) is UNetBackbone

    class Halves(torch.nn.Module):  # a stand-in that takes no class_labels argument at all
        config = SimpleNamespace(sample_size=8, in_channels=1)

        def forward(self, sample, timestep):
            return SimpleNamespace(sample=sample / 2)

    x = torch.ones(2, 1, 8, 8)
    assert torch.equal(predict(Halves(), x, torch.tensor(3)), x / 2)
