"""A Lightning ``LightningDataModule`` over a bucket folder (needs ``pip install lightning``).

    python examples/lightning_datamodule.py s3://bucket/train --devices 2

The loader from ``ds.dataloader(...)`` has ``state_dict()``/``load_state_dict()`` (the
``StatefulDataLoader`` protocol), so Lightning's mid-epoch checkpoints resume it at the next batch
with the same order; ``ElasticDistributedSampler`` lets a run come back with another number of
devices. Lightning would put its own ``DistributedSampler`` in; ``use_distributed_sampler=False``
keeps ours. The dataset is made in ``setup`` on every rank: rank 0 lists, the others receive it.
``--partitioned`` uses ``PartitionedSampler`` instead: each node reads the same share of the dataset
every epoch, so each node's cache needs to hold only its share (``nproc_per_node`` is given from the
trainer, for launchers that do not set ``LOCAL_WORLD_SIZE``).
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
    def __init__(self, url: str, *, batch_size: int = 64, num_workers: int = 4, cache_dir: str | None = None,
                 partitioned: bool = False):  # fmt: skip
        super().__init__()
        self.url, self.batch_size, self.num_workers, self.cache_dir = url, batch_size, num_workers, cache_dir
        self.partitioned = partitioned

    def setup(self, stage: str) -> None:
        self.ds = FolderDataset(self.url, loader=first_bytes, cache=self.cache_dir)

    def train_dataloader(self) -> Any:
        sampler: Any = ElasticDistributedSampler(self.ds, seed=0)  # rank and world size from the job
        if self.partitioned:  # each node one fixed share, every epoch: its cache serves every epoch
            sampler = PartitionedSampler(self.ds, seed=0, nproc_per_node=self.trainer.num_devices)
        return self.ds.dataloader(batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)


class Toy(L.LightningModule):
    def configure_model(self) -> None:  # after the data module's setup: the classes are known
        self.net = torch.nn.Linear(16, len(self.trainer.datamodule.ds.classes))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--partitioned", action="store_true", help="PartitionedSampler: one share per node")
    args = p.parse_args()
    data = BucketData(args.url, num_workers=2, partitioned=args.partitioned)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs, use_distributed_sampler=False
    )
    trainer.fit(Toy(), datamodule=data)


if __name__ == "__main__":
    main()
