"""Train a small NeMo model across nodes on CPU: NeMo's own training stack, DDP over gloo.

One process per node (started by the task on every node), as a NeMo user would write it: a
``nemo.core.ModelPT`` whose configuration is OmegaConf, Lightning's ``Trainer`` with the DDP
strategy over ``num_nodes`` nodes, and NeMo's ``exp_manager`` writing checkpoints and resuming
from the last one when there is one.  The model is a two-layer regressor: the run is about the
plumbing a multi-node NeMo job needs (the rendezvous at the head from ``SKYPILOT_NODE_IPS``,
the node rank from ``SKYPILOT_NODE_RANK``, gradients all-reduced every step, rank 0's
checkpoint), not about compute.

Each rank trains on its own shard of a fixed synthetic data set (Lightning's distributed
sampler), so only all-reduced gradients keep the weights equal.  Every rank ends with one line::

    NEMO_DONE rank=<global rank> world=<n> start=<step> steps=<step> loss=<float> weights=<sha256>

where ``start`` is the step training began at (a resumed run: the checkpoint's), ``loss`` is the
loss on a fixed evaluation set (the same data on every rank: equal weights give equal losses)
and ``weights`` a checksum of every parameter.  Settings come from the task's envs.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

FEATURES = 16
HIDDEN = 32


def setting(name: str, default: str) -> str:
    return os.environ.get(name, "").strip() or default


def config(max_steps: int, exp_dir: str) -> DictConfig:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "model": {
                "features": FEATURES,
                "hidden": HIDDEN,
                "train_ds": {"samples": 512, "batch_size": 16, "seed": 1234},
                "optim": {"name": "sgd", "lr": 0.05},
            },
            "trainer": {
                "accelerator": "cpu",
                "devices": 1,
                "num_nodes": int(setting("SKYPILOT_NUM_NODES", "1")),
                "strategy": "ddp",
                "max_steps": max_steps,
                "logger": False,  # exp_manager makes its own
                "enable_checkpointing": False,  # exp_manager adds NeMo's checkpoint callback
                "enable_progress_bar": False,
                "enable_model_summary": False,
                "log_every_n_steps": 1,
            },
            "exp_manager": {
                "exp_dir": exp_dir,
                "name": "nemo_cpu",
                "create_tensorboard_logger": False,
                "create_checkpoint_callback": True,
                "checkpoint_callback_params": {
                    "every_n_train_steps": max_steps,
                    "every_n_epochs": None,
                    "save_top_k": -1,
                    "save_last": True,
                    "save_nemo_on_train_end": False,
                    "always_save_nemo": False,
                },
                # Continue from the last checkpoint in exp_dir when there is one: run again with
                # more NEMO_MAX_STEPS and training goes on from where it stopped.
                "resume_if_exists": True,
                "resume_ignore_no_checkpoint": True,
            },
        }
    )


def main() -> None:
    started = time.monotonic()
    # Lightning's DDP on one process per node: the rendezvous at the head, this node's rank.
    os.environ.setdefault("MASTER_ADDR", setting("SKYPILOT_NODE_IPS", "127.0.0.1").splitlines()[0])
    os.environ.setdefault("MASTER_PORT", setting("MASTER_PORT", "29520"))
    os.environ["NODE_RANK"] = setting("SKYPILOT_NODE_RANK", "0")

    import lightning.pytorch as pl
    import torch
    from nemo.core import ModelPT
    from nemo.utils import logging as nemo_logging
    from nemo.utils.exp_manager import exp_manager
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(ModelPT):
        """y = a fixed random linear map of x, plus noise, learnt by a two-layer network."""

        def __init__(self, cfg: DictConfig, trainer: pl.Trainer | None = None) -> None:
            super().__init__(cfg=cfg, trainer=trainer)
            torch.manual_seed(0)  # the same initial weights on every rank, as DDP would broadcast
            self.net = torch.nn.Sequential(
                torch.nn.Linear(cfg.features, cfg.hidden), torch.nn.Tanh(), torch.nn.Linear(cfg.hidden, 1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss, prog_bar=False)
            return loss

        @staticmethod
        def data(samples: int, seed: int) -> TensorDataset:
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(samples, FEATURES, generator=gen)
            w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(7))
            return TensorDataset(x, x @ w + 0.01 * torch.randn(samples, 1, generator=gen))

        def setup_training_data(self, cfg: DictConfig) -> None:
            self._train_dl = DataLoader(self.data(cfg.samples, cfg.seed), batch_size=cfg.batch_size, shuffle=True)

        def setup_validation_data(self, cfg: DictConfig) -> None:
            self._validation_dl = None

        @classmethod
        def list_available_models(cls) -> None:
            return None

    class StartStep(pl.Callback):
        """The step training begins at: 0, or a resumed checkpoint's."""

        step = 0

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            StartStep.step = trainer.global_step

    nemo_logging.setLevel(nemo_logging.WARNING)  # NeMo's INFO prints the whole configuration
    max_steps = int(setting("NEMO_MAX_STEPS", "5"))
    exp_dir = os.path.expanduser(setting("NEMO_EXP_DIR", "~/nemo_experiments"))
    cfg = config(max_steps, exp_dir)
    trainer = pl.Trainer(**cfg.trainer, callbacks=[StartStep()])
    exp_manager(trainer, cfg.exp_manager)
    model = Regressor(cfg.model, trainer=trainer)
    model.setup_training_data(cfg.model.train_ds)
    model.setup_optimization(cfg.model.optim)
    trainer.fit(model)

    with torch.no_grad():
        held_out = Regressor.data(256, seed=99)
        loss = torch.nn.functional.mse_loss(model(held_out.tensors[0]), held_out.tensors[1]).item()
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    print(
        f"NEMO_DONE rank={trainer.global_rank} world={trainer.world_size} start={StartStep.step} "
        f"steps={trainer.global_step} loss={loss:.6f} weights={digest.hexdigest()[:16]} "
        f"seconds={time.monotonic() - started:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
