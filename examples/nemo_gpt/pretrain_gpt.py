"""Pretrain a tiny GPT with NeMo 2.x (Megatron-Core) across every GPU of every node, on mock data.

Started by torchrun on each node (one process per GPU); NeMo's Trainer and MegatronStrategy
take the world from torchrun's environment.  The model is deliberately tiny (2 layers, hidden
128, sequence 128) so that the run is about the plumbing a real pretraining job needs across
nodes (rendezvous at the head, NCCL between nodes, Megatron's data-parallel loss reduction),
not about compute.

Nothing is downloaded: ``MockDataModule`` generates random token ids, and the tokenizer is
NeMo's ``ByteLevelTokenizer`` (a fixed 512-entry vocabulary, no files) instead of the default
GPT-2 BPE one, which fetches its vocabulary from the internet and would fail on an offline
cluster.  No checkpoint is written.

Every global rank ends with one line, ``NEMO_DONE rank=<global rank> steps=<n> loss=<float>``.
The loss is Megatron's ``reduced_train_loss``, averaged over the data-parallel group, so every
rank of a healthy run prints the same value.
"""

from __future__ import annotations

import math
import os
import time

SEQ_LENGTH = 128
MICRO_BATCH_SIZE = 2


def env_int(name: str, default: int) -> int:
    """An integer setting from the task's envs, with the example's default."""
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def final_loss(metrics: dict[str, object]) -> float:
    """The last training loss Lightning saw; NeMo logs it as ``reduced_train_loss``."""
    for key in ("reduced_train_loss", "train_loss"):
        if key in metrics:
            return float(metrics[key])  # type: ignore[arg-type]
    raise RuntimeError(f"no training loss among the trainer's metrics: {sorted(metrics)}")


def main() -> None:
    started = time.monotonic()
    # Megatron-Core wants a single CUDA work queue per device for its communication overlap.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    import torch
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.bytelevel_tokenizers import ByteLevelTokenizer

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    num_nodes = env_int("SKYPILOT_NUM_NODES", 1)
    gpus_per_node = env_int("SKYPILOT_NUM_GPUS_PER_NODE", 0) or torch.cuda.device_count()
    if world != num_nodes * gpus_per_node:
        raise SystemExit(
            f"torchrun started {world} processes but the cluster has {num_nodes} node(s) x "
            f"{gpus_per_node} GPU(s); use --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE"
        )
    max_steps = env_int("NEMO_MAX_STEPS", 5)
    precision = os.environ.get("NEMO_PRECISION", "bf16-mixed")  # 16-mixed before Ampere
    # Pure data parallelism (TP = PP = 1): one micro-batch per GPU per step.
    global_batch_size = MICRO_BATCH_SIZE * world

    tokenizer = ByteLevelTokenizer()
    data = llm.MockDataModule(
        seq_length=SEQ_LENGTH,
        tokenizer=tokenizer,
        micro_batch_size=MICRO_BATCH_SIZE,
        global_batch_size=global_batch_size,
        num_workers=0,  # worker processes would cost more start-up time than they save here
        pin_memory=False,
    )
    gpt_config = llm.GPTConfig(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=512,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        init_method_std=0.02,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        make_vocab_size_divisible_by=128,
    )
    model = llm.GPTModel(gpt_config, tokenizer=tokenizer)

    strategy = nl.MegatronStrategy(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    trainer = nl.Trainer(
        num_nodes=num_nodes,
        devices=gpus_per_node,
        accelerator="gpu",
        strategy=strategy,
        plugins=nl.MegatronMixedPrecision(precision=precision),
        max_steps=max_steps,
        limit_val_batches=0,  # training only: no validation pass, no sanity check
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=False,
    )
    optim = nl.MegatronOptimizerModule(
        config=OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            weight_decay=0.0,
            bf16=precision.startswith("bf16"),
            fp16=precision.startswith("16"),
            use_distributed_optimizer=False,
        )
    )
    # Logs under ./nemo_experiments/nemo_gpt (each node's own ~/sky_workdir); no checkpoints.
    log = nl.NeMoLogger(name="nemo_gpt", use_datetime_version=False)

    llm.train(model=model, data=data, trainer=trainer, log=log, optim=optim)

    loss = final_loss(dict(trainer.callback_metrics))
    if not math.isfinite(loss):
        raise SystemExit(f"rank {rank}: training diverged, final loss {loss}")
    print(
        f"NEMO_DONE rank={rank} steps={trainer.global_step} loss={loss:.6f} "
        f"world={world} seconds={time.monotonic() - started:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
