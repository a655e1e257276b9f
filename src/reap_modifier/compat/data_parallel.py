"""Data-parallel calibration when every rank passes the same dataset: each rank reads its
share of the samples one process would use."""

from __future__ import annotations

from loguru import logger
from torch.utils.data import Sampler

__all__ = ["RankShareSampler", "patch_rank_partition"]


class RankShareSampler(Sampler[int]):
    """This rank's share of the samples one process would calibrate on, as indices
    into the *full* dataset (the calibration DataLoader is built over the full one).

    The selection is the one llm-compressor makes in a single process with the same
    arguments, ``n = min(num_calibration_samples, len(dataset))`` samples:

    - ``shuffle_calibration_samples=False``: ``LengthAwareSampler``'s choice and order
      (the ``n`` longest samples, longest first);
    - ``shuffle_calibration_samples=True``: ``RandomSampler``'s draw, made on rank 0
      from rank 0's torch RNG at iteration time (as a single process draws it) and
      broadcast, so every rank splits the same permutation.

    Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of that list: shares
    are disjoint, cover the selection, differ in size by at most one sample and keep
    the longest-first order (so batches pad little and token loads balance).
    """

    def __init__(
        self,
        dataset,
        num_samples: int | None,
        shuffle: bool,
        batch_size: int,
        rank: int,
        world_size: int,
    ):
        from llmcompressor.datasets.utils import LengthAwareSampler

        self.dataset_len = len(dataset)
        self.num_selected = min(num_samples or self.dataset_len, self.dataset_len)
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        if self.num_selected < world_size:
            raise ValueError(
                f"data-parallel calibration over {world_size} ranks needs at least one "
                f"sample per rank, but only {self.num_selected} calibration samples were "
                "selected; raise num_calibration_samples (or use fewer ranks)"
            )
        self._fixed = (
            None
            if shuffle
            else list(
                LengthAwareSampler(dataset, num_samples=self.num_selected, batch_size=batch_size)
            )
        )

    def selection(self) -> list[int]:
        """The selection over all ranks (collective when shuffling)."""
        if self._fixed is not None:
            return self._fixed
        import torch.distributed as dist
        from torch.utils.data import RandomSampler

        drawn = [
            list(RandomSampler(range(self.dataset_len), num_samples=self.num_selected))
            if self.rank == 0
            else None
        ]
        dist.broadcast_object_list(drawn, src=0)
        return drawn[0]

    def __iter__(self):
        return iter(self.selection()[self.rank :: self.world_size])

    def __len__(self) -> int:
        return len(range(self.rank, self.num_selected, self.world_size))


def patch_rank_partition() -> None:
    """Why: llm-compressor 0.14.0.1's ``_make_sampler`` indexes the full dataset with
    slice-relative indices, so every rank calibrates on the first samples (details:
    ``docs/upstream-gaps.md``).

    We keep upstream's detection (``_is_dist_and_same_ds``, a collective every rank
    runs) and upstream's sampler for every other case, and replace the partitioning
    branch by :class:`RankShareSampler`, whose indices address the full dataset.
    """
    from llmcompressor.datasets import utils as ds_utils

    original = ds_utils._make_sampler
    if getattr(original, "_reap_patched", False):
        return

    def _make_sampler(args, dataset):
        if not ds_utils._is_dist_and_same_ds(dataset):
            return original(args, dataset)
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        sampler = RankShareSampler(
            dataset,
            args.num_calibration_samples,
            args.shuffle_calibration_samples,
            args.batch_size,
            rank,
            world,
        )
        logger.info(
            f"REAP: the same dataset on all {world} ranks: rank {rank} calibrates on "
            f"{len(sampler)} of the {sampler.num_selected} samples a single process "
            f"would use ({'shuffled' if sampler.shuffle else 'longest first'})"
        )
        return sampler

    _make_sampler._reap_patched = True
    ds_utils._make_sampler = _make_sampler
