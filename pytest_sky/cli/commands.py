"""What each ``pytest-sky`` command does, once its arguments are parsed (``pytest_sky.cli``
builds the parser and dispatches here).

Every command goes through the Python API the plugin uses (``pytest_sky.cluster``); there is
no second code path.  A user's mistake raises :class:`UsageError`: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from pytest_sky import console, naming
from pytest_sky.cli import job_report, stale
from pytest_sky.errors import CommandFailedError, SkyError
from pytest_sky.protocol import LIVE, JobStatus

EXIT_USAGE = 2


class UsageError(SkyError):
    """Bad arguments: one line, exit 2."""


def whole_number(text: str) -> int:
    """``text`` as a whole number >= 1 (a node count, a job id); ValueError with the one
    line that says what was wrong, which argparse's types and ``logs``'s free words share."""
    if not text.strip().isdecimal() or int(text) < 1:
        raise ValueError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _age(created: float) -> str:
    seconds = max(0, int(time.time() - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _task_from_args(task_args: list[str], num_nodes: int | None = None, name: str | None = None):
    """A YAML path, a command after ``--``, or one quoted command string -> Task (or None).
    A command's task is named ``sky-cmd``, as ``sky`` names it; ``name`` (``-n``) wins."""
    from pytest_sky.task import as_task

    if not task_args:
        return None
    text = " ".join(task_args)
    task = _task_file(text) or as_task(text, num_nodes or 1)
    if name is None and task.source is None and not task.name:
        name = job_report.COMMAND_TASK_NAME
    return task if name is None else task.with_overrides(name=name)


def _task_file(text: str):
    """The task file ``text`` names, else None (a command, or a file that is not there).

    As ``sky``: its relative paths (``workdir: .``, ``file_mounts`` sources) resolve from the
    current directory, and a file without ``.yaml`` counts when it holds a mapping (sky runs
    a temporary file so)."""
    from pytest_sky.task import Task

    path = Path(text)
    if "\n" in text or not path.is_file():
        return None
    if not text.endswith((".yaml", ".yml")):
        try:
            import yaml

            if not isinstance(yaml.safe_load(path.read_text(encoding="utf-8")), dict):
                return None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return None
    return Task.from_yaml(text, base_dir=os.getcwd())


def _resources(args: argparse.Namespace):
    from pytest_sky.resources import Resources

    return Resources.from_kwargs(gpus=args.gpus, cpus=args.cpus, memory=args.memory)


def _cluster(name: str):
    """A cluster that runs: a stopped one is one line saying how to start it."""
    from pytest_sky.cli.power import stopped_line
    from pytest_sky.cluster import get_cluster
    from pytest_sky.state import ClusterStatus

    cluster = get_cluster(name)
    if cluster.record.status is ClusterStatus.STOPPED:
        raise UsageError(stopped_line(name))
    return cluster


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


def _check_timeout(args: argparse.Namespace) -> None:
    """Before anything is made: ``--timeout`` bounds an attached run, and a detached job has none."""
    if args.detach and args.timeout is not None:
        raise UsageError("--timeout bounds an attached run; a detached job (-d) has no deadline: drop one of them")


def _run_task(cluster, task, detach: bool, timeout: float | None = None) -> int:
    console.progress(f"submitting {'setup and run' if task.setup else 'run'} to {cluster.name}")
    job = cluster.submit(task)
    if task.setup:
        print(job_report.SETUP_DETACHED, flush=True)
    print(job_report.submitted(job.id), flush=True)
    if detach:
        console.hint(f"follow: pytest-sky logs {cluster.name} {job.id} --follow")
        return 0
    code = job_report.follow(cluster, job, timeout=timeout)
    if code != job_report.EXIT_INTERRUPTED:
        print(job_report.useful_commands(cluster.name, job.id), flush=True)
    return code


def _say_up(cluster) -> None:
    """sky's two lines of a cluster that a launch found or brought up."""
    print(job_report.launching(cluster.cloud_label), flush=True)
    print(job_report.is_up(cluster.name, cluster.num_nodes, cluster.node_ips[0]), flush=True)


def _reuse(args: argparse.Namespace, store, existing, num_nodes: int, backend: str, requested):
    """``launch`` onto a cluster of that name: started if stopped, refused if it differs.  As
    sky: a task of fewer nodes runs on the first of them; more is another cluster."""
    from pytest_sky.cli.power import start_if_stopped
    from pytest_sky.state import ClusterResources

    start_if_stopped(store, existing)  # as sky: a launch starts a stopped cluster
    cluster = _cluster(args.cluster)
    wanted = {
        "num_nodes": max(num_nodes, existing.num_nodes),
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
    if not args.fast:  # as sky's: a launch onto a cluster that is up says so too, unless --fast
        _say_up(cluster)
    return cluster


def cmd_launch(args: argparse.Namespace) -> int:
    from pytest_sky import settings
    from pytest_sky.backends.privileges import check_privileges
    from pytest_sky.cluster import bring_up
    from pytest_sky.lifecycle import plan_launch
    from pytest_sky.state import StateStore

    _check_timeout(args)
    if args.use_spot:  # sky's flag: a note, as use_spot in a task file gets
        console.note("--use-spot has no effect on a pytest-sky cluster: its nodes are never preempted")
    chosen = settings.resolve(**{o.name: getattr(args, o.dest) or None for o in settings.OPTIONS if o.on_cli})
    task, num_nodes, requested = plan_launch(
        _task_from_args(args.task, name=args.name), args.num_nodes or None, _resources(args)
    )
    backend = chosen.for_task(requested)[0].backend
    store = StateStore()
    existing = store.load(args.cluster)
    if existing is not None:
        cluster = _reuse(args, store, existing, num_nodes, backend, requested)
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
            return job_report.EXIT_INTERRUPTED
        _say_up(cluster)
    if task is None:
        console.hint(f"ssh onto it: pytest-sky ssh {cluster.name}; remove it: pytest-sky down {cluster.name}")
        return 0
    return _run_task(cluster, _with_env_options(task, args), args.detach, args.timeout)


def cmd_exec(args: argparse.Namespace) -> int:
    _check_timeout(args)
    name, words = args.cluster, list(args.task)
    if args.cluster_flag is not None:  # sky's `exec -c NAME CMD...`: the first word is the command's
        words = [name, *words] if name is not None else words
        name = args.cluster_flag
    if name is None:
        raise UsageError("name the cluster: pytest-sky exec NAME COMMAND (or -c NAME)")
    cluster = _cluster(name)
    task = _task_from_args(words, num_nodes=cluster.num_nodes, name=args.name)
    if task is None:
        raise UsageError("give a task YAML or a command after `--` (e.g. pytest-sky exec dev -- hostname)")
    return _run_task(cluster, _with_env_options(task, args), args.detach, args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    """Every cluster, or those named; ``-r``, ``-u`` and ``-v`` are sky's and change nothing
    here (every record is read fresh, and one user owns the state directory)."""
    from pytest_sky.state import StateStore

    store = StateStore()
    if args.ip:  # sky's `status --ip NAME`: the head's address, and nothing else
        if len(args.names) != 1:
            raise UsageError("--ip takes exactly one cluster name: pytest-sky status --ip NAME")
        record = store.load(args.names[0])
        if record is None or not record.node_ips:
            raise UsageError(f"no cluster named {args.names[0]!r} that is up (see `pytest-sky status`)")
        print(record.node_ips[0])
        return 0
    records = store.records()
    missing = [n for n in args.names if n not in {r.name for r in records}]
    for name in missing:
        print(f"Cluster {name!r} not found.")
    rows, modes = [], []
    for r in records:
        if args.names and r.name not in args.names:
            continue
        # A rootless local cluster (reached through its namespace holder's door) says so.
        modes.append(" (rootless)" if r.info and r.info.head.route.door else "")
        word = r.status.sky_word if not args.json else str(r.status)
        status = word if not r.orphaned else f"{word} (owner gone)"
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
    holds = stale.held(args) if stale.backend_chosen(args) else None
    if args.json:
        shown = rows if holds is None else {"clusters": rows, "held": [stale.as_json(h) for h in holds]}
        print(json.dumps(shown, indent=2))
        return 0
    if not rows and not missing:
        print("No existing clusters.")
    if rows:
        headers = ["NAME", "BACKEND", "RESOURCES", "NODES", "STATUS", "AGE"]
        table = [
            [str(row[h.lower()]) + (mode if h == "BACKEND" else "") for h in headers]
            for row, mode in zip(rows, modes, strict=True)
        ]
        console.table(headers, table)
    stale.print_held(holds or [])
    return 0


def cmd_cost_report(args: argparse.Namespace) -> int:
    """``sky cost-report``: every cluster with what it cost, which here is nothing (its nodes
    are this machine's, or pods of a cluster that bills elsewhere); sky also lists clusters
    torn down, which leave no record here."""
    from pytest_sky.state import StateStore

    rows = [
        [r.name, _age(r.created) + " ago", r.resources_label, r.status.sky_word, "$ 0.00"]
        for r in StateStore().records()
    ]
    if rows:
        console.table(["NAME", "LAUNCHED", "RESOURCES", "STATUS", "COST (est.)"], rows)
    print("Total Cost: $0.00")
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
            [
                str(j["id"]),
                str(j.get("name") or "-"),
                _age(j.get("submitted", time.time())) + " ago",
                took,
                job_report.sky_status(j["status"], j.get("failed_phase")),
            ]
        )
    console.table(["ID", "NAME", "SUBMITTED", "DURATION", "STATUS"], rows)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """``sky cancel`` forms: job ids, ``-a`` (every pending or running job), or none (the
    latest running job)."""
    cluster = _cluster(args.cluster)
    if args.all:
        ids = [j["id"] for j in cluster.queue() if j["status"] in LIVE]
    elif args.jobs:
        ids = list(args.jobs)
    else:
        console.note("No job IDs or --all provided; cancelling the latest running job.")
        ids = [j["id"] for j in cluster.queue() if j["status"] == JobStatus.RUNNING][-1:]
    done = [job_id for job_id in ids if _cancel_one(cluster, job_id)]
    print(job_report.cancelled(done))
    return 0


def _cancel_one(cluster, job_id: int) -> bool:
    """Whether this cancel stopped the job (one that had ended already, or that never
    existed, is left as it is)."""
    from pytest_sky.errors import RunError

    job = cluster.job(job_id)
    try:
        if job.status not in LIVE:
            return False
    except RunError:
        return False
    return job.cancel() == JobStatus.CANCELLED


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

    if args.stale:
        if args.names or args.all:
            raise UsageError("--stale chooses the clusters itself: name none, and pass no --all")
        return stale.down_stale(args)
    store = StateStore()
    names = [r.name for r in store.records()] if args.all else args.names
    if not names and not args.all:
        raise UsageError("name the clusters to tear down, or pass --all (or --stale)")
    missing = [n for n in names if store.load(n) is None]
    if missing:  # as sky: said, and the clusters that exist still go
        print(f"Cluster(s) not found (tip: see `pytest-sky status`): {', '.join(missing)}")
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
    strays = []
    if args.all:  # and what no record owns any more (its state directory deleted, say)
        from pytest_sky.lifecycle import reap_strays

        strays = reap_strays(store)
    for what in strays:
        print(f"{what}: removed (nothing alive owned it)")
    if not names and not strays:
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
    else:
        console.hint(
            "`pytest-sky down --all` tears down the clusters of a state directory (PYTEST_SKY_HOME, "
            "default ~/.pytest_sky) and removes what is left of those that lost their record"
        )
    holds = stale.held(args) if stale.backend_chosen(args) else []
    stale.print_held(holds)
    gone = [h.name for h in holds if h.expired]
    if gone:
        console.hint(f"stale: {', '.join(gone)}; `pytest-sky down --stale` with the same flags removes them")
    return 1 if found or gone else 0
