"""Framework smoke tests: TensorFlow and NeMo across nodes on CPU, and NCCL and NeMo on GPU nodes.

Each test runs an example task YAML from ``examples/`` unmodified on a fresh cluster and
asserts on what every rank printed, as the rest of the smoke suite does.  The frameworks are
optional extras: a test whose framework is missing is skipped with the reason and the install
hint, never installed at run time.  GPU tests carry the ``gpu`` marker, which the plugin skips
(with a reason) where the backend has no GPU.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from pytest_sky import Task
from pytest_sky.plugin import missing_on_nodes, require_on_nodes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Upper bounds on a whole run, so that a rank stuck waiting for its peers fails the test
# instead of hanging the suite.  TensorFlow takes 8-25 s to import per node on 2 busy cores;
# NeMo's imports and Megatron's set-up take minutes on a cold node.
TF_TIMEOUT_S = 300
NCCL_TIMEOUT_S = 300
NEMO_TIMEOUT_S = 900
NEMO_CPU_TIMEOUT_S = 300
NEMO_INSTALL = "pip install 'pytest-sky[nemo]' (nemo-toolkit[core,common-only])"


def gpu_request(sky_backend: str, num_nodes: int) -> str:
    """The accelerators each node of a GPU test asks for.

    A whole GPU per node where the machine has enough; otherwise (a single-GPU box running
    the local backend) nodes share one device with ``:0.5``.  NCCL tells nodes apart by
    hostname, so a shared device still sends every byte through the network transport.
    The type is not checked by the local backend: any NVIDIA GPU will do.
    """
    if sky_backend == "local":
        from pytest_sky import gpus

        visible = gpus.visible_from_env()
        devices = visible if visible is not None else gpus.detect_devices()
        if len(devices) < num_nodes:
            return "H100:0.5"
    return "H100:1"


@pytest.mark.long(6)
@pytest.mark.multinode(num_nodes=2)
def test_tf_multiworker_mirrored_strategy(sky_launch):
    """MultiWorkerMirroredStrategy with TF_CONFIG built from SKYPILOT_NODE_IPS and the node rank:
    every worker trains on its own data, so equal weight checksums prove that gradients were
    all-reduced across nodes on every step."""
    task = Task.from_yaml(EXAMPLES / "tf_multiworker" / "task.yaml")
    cluster = sky_launch(num_nodes=2)
    require_on_nodes(cluster, modules=["tensorflow"], install="pip install 'pytest-sky[tensorflow]' or tensorflow-cpu")
    res = cluster.run(task, timeout=TF_TIMEOUT_S)
    assert res.returncode == 0, res.output
    steps = task.envs["TRAIN_STEPS"]
    checksums = []
    for rank in res.ranks:
        assert re.search(rf"^rank={rank.rank} workers=2 steps={steps} loss=\S+", rank.stdout, re.M), res.output
        found = re.findall(r"^WEIGHTS_CHECKSUM (-?\d+\.\d{6})$", rank.stdout, re.M)
        assert len(found) == 1, res.output
        checksums.append(found[0])
    assert len(set(checksums)) == 1, f"workers disagree on the final weights: {checksums}"
    assert math.isfinite(float(checksums[0]))


def nemo_finished(res, start: int, steps: int) -> str:
    """Every rank's ``NEMO_DONE`` line says it trained from ``start`` to ``steps`` in a world of
    every node, and every rank ends with the same loss and weights; returns the weights."""
    assert res.returncode == 0, res.output
    line = re.compile(r"^NEMO_DONE rank=(\d+) world=(\d+) start=(\d+) steps=(\d+) loss=(\S+) weights=(\w+)", re.M)
    done = [line.findall(r.stdout) for r in res.ranks]
    assert all(len(found) == 1 for found in done), res.output
    lines = [found[0] for found in done]
    world = str(len(res.ranks))
    assert sorted(int(rank) for rank, *_ in lines) == list(range(len(res.ranks))), res.output
    assert {(w, int(s), int(n)) for _, w, s, n, _, _ in lines} == {(world, start, steps)}, lines
    assert len({(loss, weights) for *_, loss, weights in lines}) == 1, f"ranks disagree on the trained model: {lines}"
    assert math.isfinite(float(lines[0][4])), lines
    return lines[0][5]


@pytest.mark.long(27)
@pytest.mark.multinode(num_nodes=2)
def test_nemo_trains_across_nodes_on_cpu_and_resumes_from_rank0s_checkpoint(sky_launch, sky_settings):
    """NeMo's own stack (a ModelPT, Lightning's DDP over gloo, exp_manager) across 2 nodes:
    every rank trains on its own data and ends with the same loss and weights.  Then, with a
    shared directory, a second run on every rank resumes from the checkpoint rank 0 wrote
    there and continues from its step."""
    shared = sky_settings.backend != "kubernetes" or bool(sky_settings.kube_shared_pvc)
    task = Task.from_yaml(EXAMPLES / "nemo_cpu" / "task.yaml")
    cluster = sky_launch(num_nodes=2, shared_dir="/mnt/shared" if shared else None)
    require_on_nodes(cluster, modules=["nemo.core", "lightning"], install=NEMO_INSTALL)
    steps = int(task.envs["NEMO_MAX_STEPS"])
    exp_dir = {"NEMO_EXP_DIR": "/mnt/shared/nemo"} if shared else {}
    first = nemo_finished(cluster.run(task.with_overrides(envs=exp_dir), timeout=NEMO_CPU_TIMEOUT_S), 0, steps)
    if not shared:
        pytest.skip("trained across nodes; resuming from rank 0's checkpoint needs shared_dir: pass --kube-shared-pvc")
    more = task.with_overrides(envs={**exp_dir, "NEMO_MAX_STEPS": str(2 * steps)})
    assert nemo_finished(cluster.run(more, timeout=NEMO_CPU_TIMEOUT_S), steps, 2 * steps) != first


@pytest.mark.gpu
@pytest.mark.multinode(num_nodes=2)
def test_nccl_all_reduce_bandwidth_across_nodes(sky_launch, sky_backend):
    """nccl-tests' all_reduce_perf under mpirun where installed, else a torch NCCL all_reduce
    under torchrun: either way every rank of the 2-node job must have taken part and a bus
    bandwidth must come out."""
    task = Task.from_yaml(EXAMPLES / "nccl_tests" / "task.yaml")
    cluster = sky_launch(num_nodes=2, gpus=gpu_request(sky_backend, 2))
    if missing_on_nodes(cluster, commands=["all_reduce_perf", "mpirun"]):
        require_on_nodes(cluster, modules=["torch"], install="nccl-tests (all_reduce_perf, mpirun) or torch")
        check = "import torch, torch.distributed as d; assert torch.cuda.is_available() and d.is_nccl_available()"
        if cluster.run(f"python3 -c '{check}'").returncode != 0:
            pytest.skip(
                "the nodes have neither nccl-tests (all_reduce_perf, mpirun) nor a CUDA build of torch with NCCL"
            )
    res = cluster.run(task, timeout=NCCL_TIMEOUT_S)
    assert res.returncode == 0, res.output
    world = 2 * task.resources.gpus_per_node
    if all("NCCL_BENCH=nccl-tests" in r.stdout for r in res.ranks):
        # all_reduce_perf reports from MPI rank 0 (on the head): a line per rank, then the average.
        head = res.ranks[0].stdout
        ranks = {int(r) for r in re.findall(r"^#\s*Rank\s+(\d+)\s+Group", head, re.M)}
        assert ranks == set(range(world)), res.output
        avg = re.findall(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.]+)", head, re.M)
        assert len(avg) == 1 and float(avg[0]) > 0, res.output
    else:
        assert all("NCCL_BENCH=torch" in r.stdout for r in res.ranks), res.output
        merged = "".join(r.stdout for r in res.ranks)
        reported = {
            int(rank): float(busbw)
            for rank, busbw in re.findall(r"^NCCL_BUSBW rank=(\d+) world=\d+ .*busbw_gbps=([0-9.]+)$", merged, re.M)
        }
        assert sorted(reported) == list(range(world)), res.output
        assert all(bw > 0 for bw in reported.values()), reported


@pytest.mark.gpu
@pytest.mark.multinode(num_nodes=2)
def test_nemo_gpt_pretraining_across_nodes(sky_launch, sky_backend):
    """A tiny NeMo GPT pretrains on mock data over every GPU of 2 nodes: every global rank
    finishes the expected steps with the same (data-parallel averaged) finite loss."""
    task = Task.from_yaml(EXAMPLES / "nemo_gpt" / "task.yaml")
    cluster = sky_launch(num_nodes=2, gpus=gpu_request(sky_backend, 2))
    require_on_nodes(
        cluster, modules=["nemo"], install="a NeMo container, or pip install 'nemo_toolkit[nlp]' + Megatron-Core"
    )
    res = cluster.run(task, timeout=NEMO_TIMEOUT_S)
    assert res.returncode == 0, res.output
    world = 2 * task.resources.gpus_per_node
    merged = "".join(r.stdout for r in res.ranks)
    done = re.findall(r"^NEMO_DONE rank=(\d+) steps=(\d+) loss=(\S+)", merged, re.M)
    assert sorted(int(rank) for rank, _, _ in done) == list(range(world)), res.output
    assert {steps for _, steps, _ in done} == {task.envs["NEMO_MAX_STEPS"]}, done
    losses = {loss for _, _, loss in done}
    assert len(losses) == 1, f"ranks disagree on the final loss: {done}"
    assert math.isfinite(float(losses.pop())), done
