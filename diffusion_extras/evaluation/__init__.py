"""Sampling from a UNet and scoring the samples: FID / KID / FD-DINOv2 / CMMD and their backbones."""
