"""Evaluation shared by the ranks of a multi-process launch: each rank samples its batches
(metrics.sample_features), and one collective brings every rank's features to rank 0."""
from __future__ import annotations

import os


def launched_ranks() -> tuple[int, int]:
    """(this rank, ranks) of a torchrun / accelerate launch ((0, 1) for a plain process): read from
    the variables the launchers set, so a command need not build an accelerator to split its work."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def gather_to_main(features: dict, rank: int, num_ranks: int) -> dict:
    """Every rank's {first image index: features} merged on rank 0 ({} elsewhere): one collective
    over the initialised process group (gloo or NCCL)."""
    import torch.distributed as dist
    gathered = [None] * num_ranks if rank == 0 else None
    dist.gather_object(features, gathered, dst=0)
    return {first: value for part in gathered or () for first, value in part.items()}
