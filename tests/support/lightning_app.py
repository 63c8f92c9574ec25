"""Runs ``examples/lightning_datamodule.py``'s data module and model under a real Lightning ``Trainer``
(CPU, gloo under DDP) and writes down every sample each rank trained on or predicted, for
tests/test_lightning.py. A script, run in its own process: Lightning's DDP launcher starts the other
ranks by running this same command line again.

    python -m tests.support.lightning_app ROOT --log DIR [--devices 2] [--epochs 2] [--crash-at 5]
        [--ckpt-dir DIR] [--resume CKPT] [--sampler elastic|lightning] [--predict] [--stateful]
        [--strategy ddp] [--mixture]

Sample ids are the objects' first 16 bytes (``f"{id:016d}"``), which are the example model's features.
``--crash-at K`` saves a checkpoint after step K (as ``ModelCheckpoint`` does, in
``on_train_batch_end``) and then fails the run; ``--resume`` is that checkpoint. ``--stateful`` wraps
the same dataset and sampler in torchdata's ``StatefulDataLoader`` instead, to compare. ``--mixture``
reads a ``blobdata.Mixture`` of ROOT/a and ROOT/b (weights 1 and 3) through ``mix.dataloader()``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

from blobdata import Mixture

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "lightning_datamodule", ROOT / "examples" / "lightning_datamodule.py"
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
sys.modules["lightning_datamodule"] = example  # importable by name: spawned workers unpickle from it
_spec.loader.exec_module(example)
# The app reads a local folder, which has no look-ahead unless asked for (a batch reads local files
# directly); the tests check that the loaders Lightning rebuilds still fetch ahead, so ask for one.
example.FolderDataset = functools.partial(example.FolderDataset, lookahead=16)


def ids_of(x: torch.Tensor) -> list[int]:
    raw = (x * 255).round().to(torch.uint8)
    return [int(bytes(row.tolist()).decode()) for row in raw]


class Recorded(example.Toy):  # type: ignore[misc,name-defined]
    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log

    def configure_model(self) -> None:
        if not hasattr(self, "net"):  # a mixture's sources share their classes here
            ds = self.trainer.datamodule.ds  # (none where --predict alone made the model's net)
            classes = ds.sources["a"].classes if hasattr(ds, "sources") else ds.classes
            self.net = torch.nn.Linear(16, len(classes))

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.log / f"rank{self.global_rank}.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._write({"fit": ids_of(batch[0]), "epoch": self.current_epoch, "batch_idx": batch_idx})
        return super().training_step(batch, batch_idx)  # type: ignore[no-any-return]

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._write({"predict": ids_of(batch[0])})
        return super().predict_step(batch, batch_idx)  # type: ignore[no-any-return]

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader
        info: dict[str, Any] = {"loader": type(loader).__name__, "len": len(loader)}
        info["sampler"] = type(loader.sampler).__name__
        if hasattr(loader, "stats"):
            stats = loader.stats()
            info.update(samples=stats.samples, staged=stats.samples_staged)
        self._write({"end": info})


class Crash(L.Callback):
    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)
            raise SystemExit(3)  # the job dies here: what the checkpoint holds is all that is left


class StatefulData(example.BucketData):  # type: ignore[misc,name-defined]
    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        sampler = example.ElasticDistributedSampler(self.ds, seed=0)
        return StatefulDataLoader(
            self.ds, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers
        )


class MixtureData(example.BucketData):  # type: ignore[misc,name-defined]
    def setup(self, stage: str) -> None:
        root = Path(self.url)
        sources = {k: example.FolderDataset(str(root / k), loader=example.first_bytes) for k in "ab"}
        self.ds = Mixture(sources, {"a": 1, "b": 3})

    def train_dataloader(self) -> Any:
        return self.ds.dataloader(batch_size=self.batch_size, num_workers=self.num_workers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--sampler", default="elastic")
    p.add_argument("--crash-at", type=int, default=0)
    p.add_argument("--ckpt", type=Path, default=None)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--predict", action="store_true")
    p.add_argument("--fit", action="store_true")
    p.add_argument("--stateful", action="store_true")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--mixture", action="store_true")
    args = p.parse_args()
    args.log.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cls = StatefulData if args.stateful else MixtureData if args.mixture else example.BucketData
    data = cls(args.root, batch_size=args.batch_size, num_workers=args.workers, sampler=args.sampler)
    callbacks = [Crash(args.crash_at, args.ckpt)] if args.crash_at else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    model = Recorded(args.log)
    if args.fit:
        trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    if args.predict:
        if not args.fit:
            data.setup("predict")
            model.net = torch.nn.Linear(16, len(data.ds.classes))
        loader = data.ds.dataloader(batch_size=args.batch_size, num_workers=args.workers)
        out = trainer.predict(model, dataloaders=loader)
        model._write({"predictions": sum(len(o) for o in out or [])})


if __name__ == "__main__":
    main()
