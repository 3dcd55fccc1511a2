"""A job across its ranks: setup on every node, then run, the first failure stopping the rest.

The head starts every rank of a phase at once (:class:`~pytest_sky.agent.rank.Rank`: its own
locally, the workers' through their agent servers or over head-to-worker SSH), watches each
from a thread of its own, and closes every other rank's lifeline when one fails or the job
is cancelled.  Each rank's environment is SkyPilot's: its variables, then the task's envs and
secrets, then the node's.
"""

from __future__ import annotations

import os
import time

from pytest_sky import shell
from pytest_sky.agent.queue import leave, take_turn
from pytest_sky.agent.rank import SETUP_UNSET, STOP_GRACE_SECONDS, Rank
from pytest_sky.agent.records import Emitter, update
from pytest_sky.protocol import (
    DoneEvent,
    ExitEvent,
    FailedPhase,
    JobRecord,
    JobStatus,
    NodeRef,
    PhaseEvent,
    RunSpec,
    to_json,
)

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    import threading


# The lines sky's job driver writes into a job's log (so ``sky launch`` streams them and ``sky
# logs`` replays them): while the job waits for its turn, once it has it, and when its setup
# failed.  Scripts and CI written against ``sky`` grep for them.
def _waiting_line(num_nodes: int) -> str:
    return f"├── Waiting for task resources on {num_nodes} node{'s' if num_nodes > 1 else ''}.\n"


STARTED_LINE = "└── Job started. Streaming logs... (Ctrl-C to exit log streaming; job will not be killed)\n"


def _setup_failed_line(job_id: int, failed: list[Rank]) -> str:
    workers = ", ".join(f"(pid={r.pid}, returncode={r.code})" for r in failed)
    return f"ERROR: Job {job_id}'s setup failed. Failed workers: {workers}. See error logs above for more details.\n"


def _rank_envs(spec: RunSpec, task_id: str):
    """Each phase's environment of a rank: SkyPilot's variables, the task's envs and secrets,
    the node's."""
    ips = "\n".join(n.ip for n in spec.nodes)
    gpus = str(spec.gpus_per_node)
    base = dict(spec.env)
    base.update(spec.secrets)
    base["SKYPILOT_TASK_ID"] = task_id
    base["SKYPILOT_CLUSTER_INFO"] = to_json(spec.cluster_info, ", ", ": ")
    base["SKYPILOT_NUM_NODES"] = str(spec.num_nodes)

    def with_node(env: dict, node: NodeRef, leave_out: tuple[str, ...] = ()) -> dict:
        # The backend's per-node values (CUDA_VISIBLE_DEVICES) yield to the task's own envs.
        for key, value in node.env.items():
            if key not in base and key not in leave_out:
                env[key] = value
        if node.rank == 0:  # its agent, for the leftover check: not its parent where served
            env[shell.RUN_AGENT_VAR] = str(os.getpid())
        return env

    def setup_env(node: NodeRef) -> dict:
        env = dict(base)
        env.update(
            SKYPILOT_SETUP_NODE_IPS=ips,
            SKYPILOT_SETUP_NODE_RANK=str(node.rank),
            SKYPILOT_SETUP_NUM_GPUS_PER_NODE=gpus,
        )
        return with_node(env, node, leave_out=SETUP_UNSET)

    def run_env(node: NodeRef) -> dict:
        env = dict(base)
        env.update(SKYPILOT_NODE_IPS=ips, SKYPILOT_NODE_RANK=str(node.rank), SKYPILOT_NUM_GPUS_PER_NODE=gpus)
        return with_node(env, node)

    return setup_env, run_env


def _run_phase(
    phase: str,
    script: str,
    spec: RunSpec,
    env_for,
    emitter: Emitter,
    cancelled: threading.Event,
) -> tuple[list[int], int, str | None, list[Rank]]:
    """Run one phase on every rank; the first failure stops the others.  The exit codes, the
    phase's, why it failed, and the rank that failed first (in a list: empty where none did)."""
    import threading

    from pytest_sky.agent.remote import secret
    from pytest_sky.masking import masked_values

    door = secret()
    masks = masked_values(spec.secrets)
    ranks = [Rank(node, spec, phase, script, env_for(node), emitter, door, masks) for node in spec.nodes]
    first_failure: list[Rank] = []
    done = threading.Event()
    lock = threading.Lock()
    remaining = [len(ranks)]

    def ended(r: Rank) -> None:  # in the rank's own thread
        code = r.code if r.code is not None else 137
        emitter.event(ExitEvent(r.rank, code, phase, round(time.time(), 3)))
        with lock:
            if code != 0 and not first_failure and not cancelled.is_set():
                first_failure.append(r)
                for other in ranks:
                    if other is not r:
                        other.stop()
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    for r in ranks:
        r.start(ended)
    while not done.wait(0.2):
        if cancelled.is_set():
            for r in ranks:
                r.stop()
            break
    done.wait(STOP_GRACE_SECONDS + 10)
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    codes = [r.code if r.code is not None else 137 for r in ranks]
    if cancelled.is_set() and not first_failure:
        return codes, 130, "the run was interrupted: every rank was stopped", []
    if first_failure:
        return codes, *first_failure[0].failure(phase), first_failure
    return codes, 0, None, []


def execute(spec: RunSpec, record: JobRecord, job_dir: str, emitter: Emitter, cancelled, bell: list) -> JobRecord:
    """Wait for the job's turn in the queue, run setup then run on every rank; record and
    return the job's final status, and let the jobs still pending look again."""
    try:
        return _execute(spec, record, job_dir, emitter, cancelled, bell)
    finally:
        leave(record)


def _execute(spec: RunSpec, record: JobRecord, job_dir: str, emitter: Emitter, cancelled, bell: list) -> JobRecord:
    emitter.log(_waiting_line(spec.num_nodes))
    if take_turn(record, job_dir, spec, cancelled, bell):
        emitter.log(STARTED_LINE)
    setup_env, run_env = _rank_envs(spec, record.task_id)
    returncode, error, codes, failed_phase = 0, None, [0] * spec.num_nodes, None
    for phase, script, env_for in (("setup", spec.setup, setup_env), ("run", spec.run, run_env)):
        if not script or cancelled.is_set():
            continue
        emitter.event(PhaseEvent(phase))
        codes, returncode, error, failed = _run_phase(phase, script, spec, env_for, emitter, cancelled)
        if error:
            failed_phase = FailedPhase(phase)
            if failed and failed_phase is FailedPhase.SETUP:
                emitter.log(_setup_failed_line(record.id, failed))
            break
    if cancelled.is_set() and returncode == 0 and not error:
        returncode, error = 130, "the job was cancelled before it ran"
    status = JobStatus.SUCCEEDED
    if returncode != 0:
        status = JobStatus.CANCELLED if cancelled.is_set() else JobStatus.FAILED
    emitter.event(DoneEvent(returncode, status, error, codes))
    failed_phase = failed_phase if status == JobStatus.FAILED else None
    return update(
        job_dir, status=status, returncode=returncode, error=error, failed_phase=failed_phase, ended=time.time()
    )
