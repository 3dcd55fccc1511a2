"""Train a tiny Keras model with MultiWorkerMirroredStrategy on every node of a SkyPilot cluster.

TF_CONFIG is built here from SKYPILOT_NODE_IPS and SKYPILOT_NODE_RANK rather than in the YAML,
so that the same script runs unchanged under `sky launch` and pytest-sky, and so that the
cluster spec (one worker per IP, in rank order, head first) cannot drift from SkyPilot's.

Every worker prints ``WEIGHTS_CHECKSUM <sum>``: the sum of all final weights, rounded to six
decimals. MultiWorkerMirroredStrategy all-reduces the gradients every step, so workers that
really trained together end with the same weights and the same checksum, while a worker that
silently trained alone (a broken TF_CONFIG) would diverge from the others.
"""

from __future__ import annotations

import json
import os
import time

# Before TensorFlow is imported: CPU only, whatever devices the node has (a GPU would make
# start-up slower and the checksum depend on the device), and no INFO/WARNING chatter from the
# C++ runtime.  CUDA_VISIBLE_DEVICES is forced, not defaulted: a GPU node's launcher sets it.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SEED = 1234
STEPS = int(os.environ.get("TRAIN_STEPS", "5"))
GLOBAL_BATCH = 32
FEATURES = 8


def build_tf_config() -> dict[str, object]:
    """The TF_CONFIG of this node: every node is a worker, its task index is its node rank."""
    ips = [ip.strip() for ip in os.environ["SKYPILOT_NODE_IPS"].splitlines() if ip.strip()]
    rank = int(os.environ["SKYPILOT_NODE_RANK"])
    port = int(os.environ.get("TF_WORKER_PORT", "12345"))
    return {"cluster": {"worker": [f"{ip}:{port}" for ip in ips]}, "task": {"type": "worker", "index": rank}}


def main() -> None:
    start = time.monotonic()
    tf_config = build_tf_config()
    os.environ["TF_CONFIG"] = json.dumps(tf_config)

    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    import_s = time.monotonic() - start

    # The strategy must exist before any other TensorFlow op: it starts this worker's gRPC
    # server and waits for the others.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf.keras.utils.set_random_seed(SEED)

    # Each worker makes its own synthetic regression data (seed + rank) and feeds it as is
    # (autosharding off: there are no files to split).  Workers then end with the same weights
    # only if every step's gradients were all-reduced across them.
    rank = int(tf_config["task"]["index"])  # type: ignore[index]
    rng = np.random.default_rng(SEED + rank)
    true_w = np.random.default_rng(SEED).standard_normal((FEATURES, 1))
    x = rng.standard_normal((GLOBAL_BATCH * STEPS, FEATURES)).astype("float32")
    y = (x @ true_w + 0.1).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)

    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input(shape=(FEATURES,)),
                tf.keras.layers.Dense(16, activation="relu"),
                tf.keras.layers.Dense(1),
            ]
        )
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.05)

    # A custom loop, not model.fit: Keras 3's fit does not accept MultiWorkerMirroredStrategy's
    # per-replica batches.  The optimizer all-reduces (sums) the gradients across workers, so
    # each replica's loss is averaged over the global batch.
    @tf.function
    def train_step(batch: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        def replica_step(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(features, training=True) - labels), axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    batches = iter(strategy.experimental_distribute_dataset(dataset))
    loss = float("nan")
    for _ in range(STEPS):
        loss = float(train_step(next(batches)))
    checksum = float(sum(np.asarray(w, dtype="float64").sum() for w in model.get_weights()))
    print(
        f"rank={rank} workers={strategy.num_replicas_in_sync} steps={STEPS} loss={loss:.6f} "
        f"import_s={import_s:.1f} total_s={time.monotonic() - start:.1f}",
        flush=True,
    )
    print(f"WEIGHTS_CHECKSUM {checksum:.6f}", flush=True)


if __name__ == "__main__":
    main()
