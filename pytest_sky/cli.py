"""``pytest-sky``: the same clusters as the plugin, by hand.

Users debug a failing multi-node test by launching the same cluster, looking at it, going
onto the head and from there to a worker, rerunning the task and reading the logs.  Every
command goes through the Python API the plugin uses (``pytest_sky.cluster``); there is no
second code path.  User errors are one line and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from pytest_sky import console, naming
from pytest_sky.errors import CommandFailedError, SkyError
from pytest_sky.protocol import LIVE, JobStatus

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(SkyError):
    """Bad arguments: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line that says where to look, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        console.error(f"{message} (see `{self.prog} --help`)")
        sys.exit(EXIT_USAGE)


# ----------------------------------------------------------------------------- helpers


def _age(created: float) -> str:
    seconds = max(0, int(time.time() - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _task_from_args(task_args: list[str], num_nodes: int | None = None):
    """A YAML path, a command after ``--``, or one quoted command string -> Task (or None)."""
    from pytest_sky.task import as_task

    return as_task(" ".join(task_args), num_nodes or 1) if task_args else None


def _resources(args: argparse.Namespace):
    from pytest_sky.resources import Resources

    return Resources.from_kwargs(gpus=args.gpus, cpus=args.cpus, memory=args.memory)


def _cluster(name: str):
    from pytest_sky.cluster import get_cluster

    return get_cluster(name)


def _follow(cluster, job) -> int:
    """Stream a job's log; Ctrl-C stops following, never the job."""
    try:
        for line in job.logs(follow=True):
            print(line, flush=True)
        status = job.wait(60)
    except KeyboardInterrupt:
        console.hint(
            f"job {job.id} keeps running on {cluster.name}; follow it with "
            f"`pytest-sky logs {cluster.name} {job.id} --follow`, stop it with "
            f"`pytest-sky cancel {cluster.name} {job.id}`"
        )
        return EXIT_INTERRUPTED
    result = job.result()
    if result is not None and result.error:
        console.error(f"job {job.id}: {result.error}")
    if result is not None:
        return result.returncode
    return 0 if status == JobStatus.SUCCEEDED else 1


def _pairs(items: list[str], option: str) -> dict[str, str]:
    """``KEY=VALUE`` as given, or ``KEY`` alone: its value in this shell (as SkyPilot's CLI)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            if key not in os.environ:
                raise UsageError(f"{option} {key}: {key} is not set in this shell; give {key}=VALUE")
            value = os.environ[key]
        out[key] = value
    return out


def _env_file(path: str | None) -> dict[str, str]:
    """A dotenv file: ``KEY=VALUE`` lines, ``#`` comments, an optional ``export``, quotes dropped."""
    if path is None:
        return {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"--env-file {path}: cannot read it ({reason})") from None
    out = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        key, sep, value = text.removeprefix("export ").partition("=")
        if not sep:
            raise UsageError(f"--env-file {path}, line {number}: expected KEY=VALUE, got {text[:60]!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _with_env_options(task, args: argparse.Namespace):
    """The task with ``--env-file``, ``--env`` (over the file) and ``--secret`` applied."""
    envs = {**_env_file(args.env_file), **_pairs(args.env, "--env")}
    secrets = _pairs(args.secret, "--secret")
    return task.with_overrides(envs=envs, secrets=secrets) if envs or secrets else task


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Where a launched cluster runs (the settings table's flags, as pytest has them), whether
    its nodes share a directory, what they may do."""
    from pytest_sky import settings

    for option in settings.OPTIONS:
        if option.on_cli:
            p.add_argument(option.flag, dest=option.dest, **option.argparse_kwargs(option.env))
    p.add_argument("--shared-dir", metavar="PATH", help="one directory shared by every node at PATH (e.g. /mnt/shared)")
    p.add_argument(
        "--cap-add",
        action="append",
        default=[],
        metavar="CAP",
        help="a capability the nodes get beyond a pod's (e.g. NET_ADMIN; repeatable), as in a pod's securityContext",
    )
    p.add_argument(
        "--privileged",
        action="store_true",
        help="nodes hold every privilege of this machine's root (a task can change this machine); as a privileged pod",
    )


def _add_env_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]", help="an env of the task (repeatable)")
    p.add_argument("--env-file", metavar="PATH", help="envs from a dotenv file (--env wins over it)")
    p.add_argument(
        "--secret", action="append", default=[], metavar="KEY[=VALUE]", help="a secret of the task (never printed)"
    )


def _run_task(cluster, task, detach: bool) -> int:
    console.progress(f"submitting {'setup and run' if task.setup else 'run'} to {cluster.name}")
    job = cluster.submit(task)
    if detach:
        print(f"job {job.id} submitted to {cluster.name}")
        console.hint(f"follow: pytest-sky logs {cluster.name} {job.id} --follow")
        return 0
    return _follow(cluster, job)


# ----------------------------------------------------------------------------- commands


def cmd_launch(args: argparse.Namespace) -> int:
    from pytest_sky import settings
    from pytest_sky.backends.privileges import check_privileges
    from pytest_sky.cluster import bring_up
    from pytest_sky.lifecycle import plan_launch
    from pytest_sky.state import ClusterResources, StateStore

    chosen = settings.resolve(**{o.name: getattr(args, o.dest) or None for o in settings.OPTIONS if o.on_cli})
    task, num_nodes, requested = plan_launch(_task_from_args(args.task), args.num_nodes or None, _resources(args))
    backend = chosen.for_task(requested)[0].backend
    store = StateStore()
    existing = store.load(args.cluster)
    if existing is not None:
        cluster = _cluster(args.cluster)
        wanted = {
            "num_nodes": num_nodes,
            "backend": backend,
            "accelerators": ClusterResources.of(requested).accelerators,
        }
        have = {
            "num_nodes": existing.num_nodes,
            "backend": existing.backend,
            "accelerators": existing.resources.accelerators,
        }
        if wanted != have:
            diff = ", ".join(f"{k} {have[k]} (asked {wanted[k]})" for k in wanted if wanted[k] != have[k])
            raise UsageError(
                f"cluster {args.cluster} exists with different resources: {diff}; "
                f"use `pytest-sky down {args.cluster}` first or pick another name"
            )
        console.progress(f"reusing {args.cluster} ({existing.resources_label})")
    else:
        try:
            cluster, task = bring_up(
                task,
                num_nodes,
                requested,
                name=args.cluster,
                settings=chosen,
                keep=True,
                shared_dir=args.shared_dir,
                privileges=check_privileges(args.cap_add, args.privileged),
                store=store,
            )
        except KeyboardInterrupt:
            console.error(f"interrupted while launching {args.cluster}: removed what was created")
            return EXIT_INTERRUPTED
    if task is None:
        print(f"{cluster.name} is up: {cluster.num_nodes} node(s), head {cluster.node_ips[0]}")
        console.hint(f"ssh onto it: pytest-sky ssh {cluster.name}; remove it: pytest-sky down {cluster.name}")
        return 0
    return _run_task(cluster, _with_env_options(task, args), args.detach)


def cmd_exec(args: argparse.Namespace) -> int:
    cluster = _cluster(args.cluster)
    task = _task_from_args(args.task, num_nodes=cluster.num_nodes)
    if task is None:
        raise UsageError("give a task YAML or a command after `--` (e.g. pytest-sky exec dev -- hostname)")
    return _run_task(cluster, _with_env_options(task, args), args.detach)


def cmd_status(args: argparse.Namespace) -> int:
    from pytest_sky.lifecycle import owner_alive
    from pytest_sky.state import StateStore

    rows = []
    for r in StateStore().records():
        status = r.status if (r.keep or owner_alive(r)) else f"{r.status} (owner gone)"
        rows.append(
            {
                "name": r.name,
                "backend": r.backend,
                "resources": r.resources_label,
                "nodes": r.num_nodes,
                "status": status,
                "age": _age(r.created),
                "head": r.info.head.route.hostname if r.info else "",
                "node_ips": r.node_ips,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no clusters")
        return 0
    headers = ["NAME", "BACKEND", "RESOURCES", "NODES", "STATUS", "AGE"]
    console.table(headers, [[str(row[h.lower()]) for h in headers] for row in rows])
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    cluster = _cluster(args.cluster)
    jobs = cluster.queue()
    if not jobs:
        print(f"no jobs on {cluster.name}")
        return 0
    rows = []
    for j in jobs:
        ended = j.get("ended") or time.time()
        took = f"{ended - j['started']:.1f}s" if j.get("started") else "-"
        rows.append(
            [str(j["id"]), str(j.get("name") or "-"), _age(j.get("submitted", time.time())) + " ago", took, j["status"]]
        )
    console.table(["ID", "NAME", "SUBMITTED", "DURATION", "STATUS"], rows)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    cluster = _cluster(args.cluster)
    job_id = args.job
    if job_id is None:
        jobs = cluster.queue()
        if not jobs:
            raise UsageError(f"no jobs on {cluster.name} yet")
        job_id = jobs[-1]["id"]
    job = cluster.job(job_id)
    job.info()  # an unknown job id is a one-line error, not an empty log
    if args.follow:
        return _follow(cluster, job)
    sys.stdout.write(job.logs())
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    cluster = _cluster(args.cluster)
    if args.all:
        ids = [j["id"] for j in cluster.queue() if j["status"] in LIVE]
    elif args.job is not None:
        ids = [args.job]
    else:
        raise UsageError("name a job id or pass --all")
    for job_id in ids:
        status = cluster.job(job_id).cancel()
        print(f"job {job_id}: {status}")
    if not ids:
        print(f"no running jobs on {cluster.name}")
    return 0


def _node_alias(cluster, node: str | None) -> str:
    rank = naming.parse_node(node, cluster.num_nodes)
    if rank is None:
        raise UsageError(
            f"no node {node!r} in {cluster.name}: use head, worker1..worker{cluster.num_nodes - 1} or a rank"
        )
    return cluster.name if rank == 0 else f"{cluster.name}-{naming.node_name(rank)}"


def cmd_ssh(args: argparse.Namespace) -> int:
    cluster = _cluster(args.cluster)
    alias = _node_alias(cluster, args.node)
    argv = ["ssh", "-F", cluster.ssh_config]
    if not args.command and sys.stdin.isatty():
        argv.append("-t")
    argv.append(alias)
    if args.command:
        argv.append(" ".join(args.command) if len(args.command) > 1 else args.command[0])
    sys.stdout.flush()
    os.execvp("ssh", argv)
    return 0  # not reached


def _include_line() -> str:
    from pytest_sky.state import home

    return f"Include {home() / 'clusters'}/*/ssh_config"


def cmd_ssh_config(args: argparse.Namespace) -> int:
    line = _include_line()
    if not args.install:
        print(line)
        console.hint("add that line at the top of ~/.ssh/config (or run with --install) to `ssh <cluster>`")
        return 0
    ssh_dir = Path.home() / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    config = ssh_dir / "config"
    text = config.read_text() if config.exists() else ""
    if line in text.splitlines():
        print(f"already installed in {config}")
        return 0
    if config.exists():
        backup = config.with_name("config.pytest-sky.bak")
        shutil.copy2(config, backup)
        console.hint(f"backed up {config} to {backup}")
    # At the top: an Include after a Host line would only apply inside that Host block.
    config.write_text(f"# added by pytest-sky ssh-config --install\n{line}\n\n{text}")
    os.chmod(config, 0o600)
    print(f"installed in {config}: ssh <cluster> and ssh <cluster>-worker1 now work")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Every named cluster is tried; one that cannot be torn down (its backend unreachable)
    does not stop the others, and the error says ``--purge`` forgets it."""
    from pytest_sky.lifecycle import teardown
    from pytest_sky.state import StateStore

    store = StateStore()
    names = [r.name for r in store.records()] if args.all else args.names
    if not names and not args.all:
        raise UsageError("name the clusters to tear down, or pass --all")
    missing = [n for n in names if store.load(n) is None]
    if missing:
        raise UsageError(f"no cluster named {missing[0]!r} (see `pytest-sky status`)")
    failed = []
    for name in names:
        record = store.load(name)
        if record is None:
            continue
        try:
            left = teardown(record, store, purge=args.purge)
        except SkyError as exc:
            console.error(f"{name}: {exc}")
            failed.append(name)
            continue
        if left:
            console.error(f"{name}: {left}")
        print(f"{name}: {'purged' if left else 'down'}")
    if failed:
        raise UsageError(
            f"not torn down: {', '.join(failed)}; if that cannot be fixed, `pytest-sky down --purge "
            f"{' '.join(failed)}` forgets them anyway and says what may be left where"
        )
    if not names:
        print("no clusters")
    return 0


def cmd_stress_ssh(args: argparse.Namespace) -> int:
    from pytest_sky.ssh.parallel import run_command_in_parallel

    cluster = _cluster(args.cluster)
    cmd = ["ssh", "-F", cluster.ssh_config, cluster.name, "echo hi"]
    latencies: list[float] = []
    ok = attempts = 0
    failures: list[str] = []
    for round_no in range(1, args.rounds + 1):
        start = time.monotonic()
        try:
            results = run_command_in_parallel(cmd, args.parallel, args.parallel, fail_fast=False)
        except CommandFailedError as exc:  # only a broken command line gets here
            raise UsageError(str(exc)) from None
        wall = time.monotonic() - start
        for r in results:
            attempts += 1
            latencies.append(r.seconds)
            if r.returncode == 0 and r.output.strip() == "hi":
                ok += 1
            elif len(failures) < 5:
                failures.append(f"exit {r.returncode}: {r.output.strip()[:200]}")
        console.progress(f"round {round_no}/{args.rounds}: {wall:.3f} s")
    latencies.sort()
    p50 = statistics.median(latencies) if latencies else 0.0
    p95 = latencies[max(0, int(len(latencies) * 0.95) - 1)] if latencies else 0.0
    print(
        f"{ok}/{attempts} succeeded; connection latency p50 {p50 * 1000:.0f} ms, "
        f"p95 {p95 * 1000:.0f} ms, max {(latencies[-1] if latencies else 0) * 1000:.0f} ms"
    )
    for f in failures:
        console.error(f)
    return 0 if ok == attempts and attempts else 1


def _rank_arg(cluster, text: str) -> int:
    rank = naming.parse_node(text, cluster.num_nodes) if text else None
    if rank is None:
        raise UsageError(
            f"no node {text!r} in {cluster.name}: use head, worker1..worker{cluster.num_nodes - 1} or a rank"
        )
    return rank


def _describe_faults(cluster) -> str:
    faults = cluster.network_faults
    parts = [f"{sorted(a)} | {sorted(b)}" for a, b in faults.partitions]
    links = [
        f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in vars(d).items() if v)
        for r, d in sorted(faults.degraded.items())
    ]
    lines = [f"partitions: {'; '.join(parts) or 'none'}", f"degraded: {'; '.join(links) or 'none'}"]
    return "\n".join([*lines, f"link shaping: {cluster.link_shaping}"])


def cmd_fault(args: argparse.Namespace) -> int:
    """One fault on a running cluster, through the same ``Cluster`` methods a test calls."""
    cluster = _cluster(args.cluster)
    action = args.action
    if action == "kill":
        cluster.kill_node(_rank_arg(cluster, args.node))
    elif action == "restart":
        cluster.restart_node(_rank_arg(cluster, args.node), wipe=args.wipe)
    elif action == "partition":
        groups = [[_rank_arg(cluster, n) for n in g.split(",") if n] for g in (args.group_a, args.group_b)]
        cluster.partition(*groups)
    elif action == "degrade":
        cluster.degrade(
            _rank_arg(cluster, args.node),
            delay_ms=args.delay_ms,
            jitter_ms=args.jitter_ms,
            loss_pct=args.loss_pct,
            rate_mbit=args.rate_mbit,
        )
    elif action == "heal":
        cluster.heal()
    print(_describe_faults(cluster))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from pytest_sky.doctor import leftovers

    found = leftovers()
    for line in found:
        print(line)
    if not found:
        print("nothing of pytest-sky is left on this machine")
    return 1 if found else 0


# ----------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="pytest-sky",
        description="Multi-node test clusters by hand: the same clusters and tasks as the pytest plugin.",
        epilog="examples:\n"
        "  pytest-sky launch -c dev --num-nodes 2 -- 'echo $SKYPILOT_NODE_IPS'\n"
        "  pytest-sky ssh dev            # onto the head; then: ssh dev-worker1\n"
        "  pytest-sky exec dev examples/torch_allreduce/task.yaml\n"
        "  pytest-sky status\n"
        "  pytest-sky down dev",
        formatter_class=fmt,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, help_text: str, examples: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help_text, description=help_text, epilog="examples:\n" + examples, formatter_class=fmt
        )
        p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
        return p

    _add_job_commands(add)
    _add_node_commands(add)
    _add_fault_command(add)
    return parser


def _add_job_commands(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """launch, exec, status, queue, logs, cancel: clusters and the jobs on them."""
    p = add(
        "launch",
        "provision a cluster (or reuse one of that name) and run a task or command on it",
        "  pytest-sky launch -c dev --num-nodes 2\n"
        "  pytest-sky launch -c dev --num-nodes 2 -- 'echo $SKYPILOT_NODE_RANK'\n"
        "  pytest-sky launch -c train examples/torch_allreduce/task.yaml\n"
        "  pytest-sky launch -c dev -d -- 'sleep 600'   # detach after submitting",
    )
    p.add_argument("-c", "--cluster", required=True, metavar="NAME", help="cluster name")
    p.add_argument("--num-nodes", type=_positive_int, metavar="N", help="number of nodes (default: the task's, or 1)")
    p.add_argument("--gpus", metavar="SPEC", help="accelerators per node, e.g. V100:1 or V100:0.5")
    p.add_argument("--cpus", metavar="N", help="CPUs per node, e.g. 2 or 4+")
    p.add_argument("--memory", metavar="GB", help="memory per node in GB, e.g. 8 or 16+")
    _add_cluster_options(p)
    p.add_argument("-d", "--detach", action="store_true", help="submit the task and return")
    _add_env_options(p)
    p.add_argument("task", nargs="*", metavar="TASK.yaml | COMMAND", help="a task YAML, or a command (after --)")
    p.set_defaults(func=cmd_launch)

    p = add(
        "exec",
        "run a task or command on an existing cluster (a new job)",
        "  pytest-sky exec dev -- hostname\n  pytest-sky exec dev task.yaml\n  pytest-sky exec dev -d -- 'sleep 60'",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("-d", "--detach", action="store_true", help="submit and return")
    _add_env_options(p)
    p.add_argument("task", nargs="*", metavar="TASK.yaml | COMMAND")
    p.set_defaults(func=cmd_exec)

    p = add("status", "list clusters", "  pytest-sky status\n  pytest-sky status --json")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = add("queue", "list a cluster's jobs", "  pytest-sky queue dev")
    p.add_argument("cluster", metavar="NAME")
    p.set_defaults(func=cmd_queue)

    p = add(
        "logs",
        "show a job's log (the latest job by default)",
        "  pytest-sky logs dev\n  pytest-sky logs dev 3 --follow",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("job", nargs="?", type=_positive_int, metavar="JOB")
    p.add_argument("-f", "--follow", action="store_true", help="stream until the job ends")
    p.set_defaults(func=cmd_logs)

    p = add("cancel", "stop a job on every node", "  pytest-sky cancel dev 3\n  pytest-sky cancel dev --all")
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("job", nargs="?", type=_positive_int, metavar="JOB")
    p.add_argument("--all", action="store_true", help="every pending or running job")
    p.set_defaults(func=cmd_cancel)


def _add_node_commands(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """ssh, ssh-config, down, stress-ssh, doctor: reaching nodes and cleaning up."""
    p = add(
        "ssh",
        "open a shell (or run one command) on a node, host keys checked",
        "  pytest-sky ssh dev\n  pytest-sky ssh dev worker1\n  pytest-sky ssh dev 1 -- nvidia-smi",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("node", nargs="?", metavar="worker1|RANK", help="default: the head")
    p.set_defaults(func=cmd_ssh, command=[])

    p = add(
        "ssh-config",
        "print (or install) the Include line that makes `ssh <cluster>` work",
        "  pytest-sky ssh-config\n  pytest-sky ssh-config --install",
    )
    p.add_argument("--install", action="store_true", help="add it to ~/.ssh/config once (with a backup)")
    p.set_defaults(func=cmd_ssh_config)

    p = add(
        "down",
        "tear clusters down (also clusters whose owner died)",
        "  pytest-sky down dev\n  pytest-sky down --all\n  pytest-sky down --all --purge   # also unreachable ones",
    )
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--all", action="store_true", help="every cluster in the state directory")
    p.add_argument(
        "--purge",
        action="store_true",
        help="forget a cluster whose backend cannot be reached (or fails to remove it), saying what may be left",
    )
    p.add_argument("-y", "--yes", action="store_true", help="do not ask (nothing asks: kept for scripts)")
    p.set_defaults(func=cmd_down)

    p = add(
        "stress-ssh",
        "the smoke suite's SSH concurrency check: N parallel `ssh <cluster> echo hi`, R rounds",
        "  pytest-sky stress-ssh dev\n  pytest-sky stress-ssh dev --parallel 40 --rounds 5",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("--parallel", type=_positive_int, default=20, metavar="N")
    p.add_argument("--rounds", type=_positive_int, default=10, metavar="R")
    p.set_defaults(func=cmd_stress_ssh)

    p = add("doctor", "list anything of pytest-sky left on this machine", "  pytest-sky doctor")
    p.set_defaults(func=cmd_doctor)


def _add_fault_command(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """fault: kill, restart, partition, degrade, heal (and show) on a running cluster."""
    p = add(
        "fault",
        "break a running cluster on purpose (and heal it): nodes and links",
        "  pytest-sky fault dev kill worker1\n"
        "  pytest-sky fault dev restart 1 --wipe\n"
        "  pytest-sky fault dev partition 0,1 2\n"
        "  pytest-sky fault dev degrade 1 --rate-mbit 100 --loss-pct 1\n"
        "  pytest-sky fault dev heal\n"
        "  pytest-sky fault dev status",
    )
    p.add_argument("cluster", metavar="NAME")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser, required=True)
    q = actions.add_parser("kill", help="crash a node: every process on it dies at once")
    q.add_argument("node", metavar="worker1|RANK")
    q = actions.add_parser("restart", help="boot a node again: same name, IP and host key")
    q.add_argument("node", metavar="worker1|RANK")
    q.add_argument("--wipe", action="store_true", help="a fresh disk (only provisioning's files)")
    q = actions.add_parser("partition", help="drop traffic between two groups of ranks (SSH head-worker stays)")
    q.add_argument("group_a", metavar="RANKS", help="comma-separated, e.g. 0,1")
    q.add_argument("group_b", metavar="RANKS", help="comma-separated, e.g. 2")
    q = actions.add_parser("degrade", help="give a node's link latency, loss or a bandwidth cap")
    q.add_argument("node", metavar="worker1|RANK")
    q.add_argument("--delay-ms", type=float, default=0.0, metavar="MS")
    q.add_argument("--jitter-ms", type=float, default=0.0, metavar="MS")
    q.add_argument("--loss-pct", type=float, default=0.0, metavar="PCT")
    q.add_argument("--rate-mbit", type=float, default=None, metavar="MBIT")
    actions.add_parser("heal", help="undo every partition and degradation")
    actions.add_parser("status", help="show the network faults applied now")
    p.set_defaults(func=cmd_fault)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    remote: list[str] | None = None
    if "--" in argv:
        # `... -- COMMAND...`: the command is the nodes', never ours to parse (options included).
        cut = argv.index("--")
        argv, remote = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if remote is not None:
        if getattr(args, "subcommand", None) == "ssh":
            args.command = remote
        elif getattr(args, "subcommand", None) in ("launch", "exec") and not args.task:
            args.task = remote
        else:
            parser.error(f"unexpected `-- {' '.join(remote)}`")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    console.enable(True)
    try:
        return int(args.func(args))
    except SkyError as exc:
        if args.debug:
            raise
        console.error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        console.error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `pytest-sky status --json | head`: the reader left; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
