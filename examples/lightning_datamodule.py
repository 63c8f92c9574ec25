"""A Lightning ``LightningDataModule`` over a bucket folder (needs ``pip install lightning``).

    python examples/lightning_datamodule.py s3://bucket/train --devices 2 --epochs 2 --predict

The loader from ``ds.dataloader(...)`` has ``state_dict()``/``load_state_dict()`` (the
``StatefulDataLoader`` protocol), so Lightning's mid-epoch checkpoints resume it at the next batch with
the same order (``--ckpt-path``). Three ways to shard it under DDP:

- ``--sampler elastic`` (default): ``ElasticDistributedSampler``, ``DistributedSampler``'s order that
  also resumes at another number of devices. It is a ``DistributedSampler``, so Lightning keeps it.
- ``--sampler lightning``: ``ds.dataloader(batch_size=..., shuffle=True)``; Lightning rebuilds the
  loader with its own ``DistributedSampler`` (``use_distributed_sampler=True``, the default). The
  rebuilt loader is a ``BlobLoader`` too and fetches ahead the same way, and resumes a mid-epoch
  checkpoint at another number of devices or batch size (at a global batch no larger than before).
- ``--sampler partitioned``: ``PartitionedSampler``: each node reads the same share of the dataset every
  epoch, so each node's cache needs to hold only its share. The trainer is made with
  ``use_distributed_sampler=False`` so that nothing replaces it, and ``nproc_per_node`` is given from
  the trainer, for launchers that do not set ``LOCAL_WORLD_SIZE``.

The dataset is made in ``setup`` on every rank: rank 0 lists, the others receive it. At the end each
rank prints what its loader did (``loader.stats()``). The model is a toy over each object's first 16
bytes; put yours (and a ``transform=``) in its place.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from blobdata import ElasticDistributedSampler, FolderDataset, PartitionedSampler


def first_bytes(f: Any) -> torch.Tensor:
    head = f.read(16).ljust(16, b"\0")
    return torch.frombuffer(bytearray(head), dtype=torch.uint8).float() / 255


class BucketData(L.LightningDataModule):
    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 64,
        num_workers: int = 4,
        cache_dir: str | None = None,
        sampler: str = "elastic",
    ) -> None:
        super().__init__()
        self.url, self.batch_size, self.num_workers, self.cache_dir = url, batch_size, num_workers, cache_dir
        self.sampler = sampler

    def setup(self, stage: str) -> None:
        self.ds = FolderDataset(self.url, loader=first_bytes, cache=self.cache_dir)

    def train_dataloader(self) -> Any:
        if self.sampler == "lightning":  # Lightning puts its DistributedSampler in under DDP
            return self.ds.dataloader(batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)
        sampler: Any = ElasticDistributedSampler(self.ds, seed=0)  # rank and world size from the job
        if self.sampler == "partitioned":  # each node one fixed share, every epoch: its cache serves them all
            sampler = PartitionedSampler(self.ds, seed=0, nproc_per_node=self.trainer.num_devices)
        return self.ds.dataloader(batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)

    def predict_dataloader(self) -> Any:
        return self.ds.dataloader(batch_size=self.batch_size, num_workers=self.num_workers)


class Toy(L.LightningModule):
    def configure_model(self) -> None:  # after the data module's setup: the classes are known
        if not hasattr(self, "net"):
            self.net = torch.nn.Linear(16, len(self.trainer.datamodule.ds.classes))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def predict_step(self, batch: Any, _: int) -> torch.Tensor:
        x, _y = batch
        return self.net(x).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        stats = self.trainer.train_dataloader.stats()
        print(f"rank {self.global_rank}: {stats.samples} samples, {stats.samples_staged} fetched ahead")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sampler", choices=["elastic", "lightning", "partitioned"], default="elastic")
    p.add_argument("--ckpt-path", default=None, help="a checkpoint to resume from (mid-epoch too)")
    p.add_argument("--predict", action="store_true", help="then predict over the whole folder")
    args = p.parse_args()
    data = BucketData(args.url, batch_size=args.batch_size, num_workers=args.workers, sampler=args.sampler)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        use_distributed_sampler=args.sampler != "partitioned",
    )
    model = Toy()
    trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_path)
    if args.predict:
        predictions = trainer.predict(model, datamodule=data)
        print(f"rank {trainer.global_rank}: {sum(len(p) for p in predictions or [])} predictions")


if __name__ == "__main__":
    main()
