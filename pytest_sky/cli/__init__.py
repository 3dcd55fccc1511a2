"""``pytest-sky``: the same clusters as the plugin, by hand (the parser and dispatch; what each
command does is ``pytest_sky.cli.commands``).

Users debug a failing multi-node test by launching the same cluster, looking at it, going
onto the head and from there to a worker, rerunning the task and reading the logs.  Every
command goes through the Python API the plugin uses (``pytest_sky.cluster``); there is no
second code path.  User errors are one line and exit 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from pytest_sky import console
from pytest_sky.cli import job_report, stale
from pytest_sky.cli.commands import (
    EXIT_USAGE,
    cmd_cancel,
    cmd_cost_report,
    cmd_doctor,
    cmd_down,
    cmd_exec,
    cmd_fault,
    cmd_launch,
    cmd_queue,
    cmd_ssh,
    cmd_ssh_config,
    cmd_status,
    cmd_stress_ssh,
    whole_number,
)
from pytest_sky.cli.logs import cmd_logs
from pytest_sky.cli.power import cmd_start, cmd_stop
from pytest_sky.errors import SkyError


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line that says where to look, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        console.error(f"{message} (see `{self.prog} --help`)")
        sys.exit(EXIT_USAGE)


# ----------------------------------------------------------------------------- helpers


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    """Which backend, and where it reaches (the settings table's flags, as pytest has them)."""
    from pytest_sky import settings

    for option in settings.OPTIONS:
        if option.on_cli:
            p.add_argument(option.flag, dest=option.dest, **option.argparse_kwargs(option.env))


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Where a launched cluster runs, whether its nodes share a directory, what they may do."""
    _add_backend_options(p)
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


def _add_name_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n",
        "--name",
        metavar="NAME",
        help="the task's name (over the YAML's; a command's is sky-cmd), in the queue and the log prefix",
    )


def _add_yes_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-y", "--yes", action="store_true", help="do not ask (nothing asks: sky's flag, kept for scripts)")


def _add_detach_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-d",
        "--detach",
        "--detach-run",
        "--async",
        dest="detach",
        action="store_true",
        help="submit the task and return (sky's -d/--detach-run and --async)",
    )


def _add_timeout_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="stop an attached run after SECONDS, saying first where every rank waits (default: no deadline)",
    )


def _add_env_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]", help="an env of the task (repeatable)")
    p.add_argument("--env-file", metavar="PATH", help="envs from a dotenv file (--env wins over it)")
    p.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="KEY",
        help=(
            "a secret of the task, its value from this shell (repeatable); exported on every node, "
            "shown as *** in output; KEY=VALUE works too but puts the value in this command's line"
        ),
    )


# ----------------------------------------------------------------------------- commands


# ----------------------------------------------------------------------------- parser


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (e.g. 600)")
    return value


def _positive_int(text: str) -> int:
    try:
        return whole_number(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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

    _add_run_commands(add)
    _add_job_commands(add)
    _add_cost_report(add)
    _add_node_commands(add)
    _add_fault_command(add)
    return parser


def _add_run_commands(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """launch, exec: a task onto a cluster."""
    p = add(
        "launch",
        "provision a cluster (or reuse one of that name) and run a task or command on it",
        "  pytest-sky launch -c dev --num-nodes 2\n"
        "  pytest-sky launch -c dev --num-nodes 2 -- 'echo $SKYPILOT_NODE_RANK'\n"
        "  pytest-sky launch -c train examples/torch_allreduce/task.yaml\n"
        "  pytest-sky launch -c dev -d -- 'sleep 600'   # detach after submitting\n"
        "  pytest-sky launch -y -c dev -n hello 'echo hi'   # sky's form: exit 100 if the job fails\n"
        "  pytest-sky launch -y -c dev --fast --async task.yaml   # sky's flags, accepted\n"
        "  pytest-sky launch -y -c dev --use-spot task.yaml   # accepted with a note: nodes are never preempted",
    )
    p.add_argument("-c", "--cluster", required=True, metavar="NAME", help="cluster name")
    _add_name_option(p)
    _add_yes_option(p)
    p.add_argument("--num-nodes", type=_positive_int, metavar="N", help="number of nodes (default: the task's, or 1)")
    p.add_argument("--gpus", metavar="SPEC", help="accelerators per node, e.g. V100:1 or V100:0.5")
    p.add_argument("--cpus", metavar="N", help="CPUs per node, e.g. 2 or 4+")
    p.add_argument("--memory", metavar="GB", help="memory per node in GB, e.g. 8 or 16+")
    _add_cluster_options(p)
    _add_detach_option(p)
    _add_timeout_option(p)
    p.add_argument(
        "--fast",
        action="store_true",
        help="sky's flag, accepted: a reused cluster is never provisioned again here (its task's setup still runs)",
    )
    p.add_argument("--use-spot", action="store_true", help="sky's flag, accepted: nodes here are never preempted")
    _add_env_options(p)
    p.add_argument("task", nargs="*", metavar="TASK.yaml | COMMAND", help="a task YAML, or a command (after --)")
    p.set_defaults(func=cmd_launch)

    p = add(
        "exec",
        "run a task or command on an existing cluster (a new job)",
        "  pytest-sky exec dev -- hostname\n  pytest-sky exec dev task.yaml\n  pytest-sky exec dev -d -- 'sleep 60'\n"
        "  pytest-sky exec dev -n job-1 -d 'sleep 60'   # options anywhere, as sky takes them\n"
        "  pytest-sky exec dev --timeout 600 task.yaml   # a hung run says where each rank waits, then stops\n"
        "  pytest-sky exec -c dev echo hi   # sky's -c: then every word is the command's",
    )
    p.add_argument("cluster", nargs="?", metavar="NAME")
    p.add_argument("-c", "--cluster", dest="cluster_flag", metavar="NAME", help="the cluster, as an option (sky's -c)")
    _add_name_option(p)
    _add_detach_option(p)
    _add_timeout_option(p)
    _add_env_options(p)
    p.add_argument("task", nargs="*", metavar="TASK.yaml | COMMAND")
    p.set_defaults(func=cmd_exec)


def _add_job_commands(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """status, queue, logs, cancel: clusters and the jobs on them."""
    p = add(
        "status",
        "list clusters (those named, or all)",
        "  pytest-sky status\n  pytest-sky status --json\n  pytest-sky status -r dev   # sky's form\n"
        "  pytest-sky status --ip dev   # the head's IP only\n"
        "  pytest-sky status --kubernetes   # and the namespace's clusters: holder, age, kept",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="only these clusters")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-r", "--refresh", action="store_true", help="sky's flag: records are always read fresh here")
    p.add_argument("-u", "--all-users", action="store_true", help="sky's flag: one user owns the state directory")
    p.add_argument("-v", "--verbose", action="store_true", help="sky's flag: the table is already in full")
    p.add_argument("--ip", action="store_true", help="print the head's IP of the one cluster named, only")
    stale.add_where_options(p)  # with --kubernetes: also the namespace's clusters, by their leases
    p.set_defaults(func=cmd_status)

    p = add("queue", "list a cluster's jobs", "  pytest-sky queue dev")
    p.add_argument("cluster", metavar="NAME")
    p.set_defaults(func=cmd_queue)

    p = add(
        "logs",
        "show a job's log (the latest job by default), followed until it ends; exits 100 if it failed",
        "  pytest-sky logs dev\n  pytest-sky logs dev 3 --no-follow\n"
        "  pytest-sky logs dev 3 --status   # 'Job 3: SUCCEEDED'\n"
        "  pytest-sky logs dev --tail 20\n  pytest-sky logs dev 3 4 --sync-down   # 'Job 3 logs: DIR', then 4's\n"
        "  pytest-sky logs --provision dev --no-follow   # how the cluster was launched\n"
        "  exit codes: 0 succeeded, 100 failed, 101 not finished, 102 no such job, 103 cancelled",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("jobs", nargs="*", metavar="JOB", help="a job id (several, with --sync-down)")
    p.add_argument(
        "-f", "--follow", action=argparse.BooleanOptionalAction, default=True, help="stream until the job ends"
    )
    p.add_argument("--status", action="store_true", help="print the job's status only; the exit code says it too")
    p.add_argument("--tail", type=int, default=0, metavar="N", help="from the last N lines (0: all), e.g. --tail 20")
    p.add_argument(
        "-s",
        "--sync-down",
        action="store_true",
        help="save the job's log under the state directory and print where ('Job N logs: DIR'; run.log in it)",
    )
    p.add_argument(
        "--provision", action="store_true", help="the cluster's launch log instead of a job's (with --tail N)"
    )
    p.set_defaults(func=cmd_logs)

    p = add(
        "cancel",
        "stop jobs on every node (the latest running one if none is named)",
        "  pytest-sky cancel dev 3\n  pytest-sky cancel -y dev 1 2 3\n  pytest-sky cancel dev --all",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("jobs", nargs="*", type=_positive_int, metavar="JOB")
    p.add_argument("-a", "--all", action="store_true", help="every pending or running job")
    _add_yes_option(p)
    p.set_defaults(func=cmd_cancel)


def _add_cost_report(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """cost-report: sky's, for scripts that call it (a cluster here costs nothing)."""
    p = add("cost-report", "what each cluster cost: nothing here (sky's form)", "  pytest-sky cost-report --all")
    p.add_argument("-a", "--all", action="store_true", help="sky's flag: every cluster is listed already")
    p.set_defaults(func=cmd_cost_report)


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

    _add_down_command(add)

    for command, func, summary, example in (
        ("stop", cmd_stop, "power a cluster's nodes off, keeping their disks (local backend)", "pytest-sky stop dev"),
        ("start", cmd_start, "boot a stopped cluster's nodes again, disks as they were", "pytest-sky start dev"),
    ):
        p = add(command, summary, f"  {example}\n  {example.replace(' dev', ' -a')}")
        p.add_argument("names", nargs="*", metavar="NAME")
        p.add_argument("-a", "--all", action="store_true", help=f"every cluster in the state directory ({command})")
        _add_yes_option(p)
        p.set_defaults(func=func)

    p = add(
        "stress-ssh",
        "the smoke suite's SSH concurrency check: N parallel `ssh <cluster> echo hi`, R rounds",
        "  pytest-sky stress-ssh dev\n  pytest-sky stress-ssh dev --parallel 40 --rounds 5",
    )
    p.add_argument("cluster", metavar="NAME")
    p.add_argument("--parallel", type=_positive_int, default=20, metavar="N")
    p.add_argument("--rounds", type=_positive_int, default=10, metavar="R")
    p.set_defaults(func=cmd_stress_ssh)

    p = add(
        "doctor",
        "list anything of pytest-sky left on this machine (with --kubernetes: and in the namespace)",
        "  pytest-sky doctor\n  pytest-sky doctor --kubernetes --kube-namespace sky-tests",
    )
    stale.add_where_options(p)
    p.set_defaults(func=cmd_doctor)


def _add_down_command(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    """down: by name, all, the stale ones (with the backend's options: where to look)."""
    p = add(
        "down",
        "tear clusters down (also clusters whose owner died)",
        "  pytest-sky down dev\n  pytest-sky down --all\n  pytest-sky down --all --purge   # also unreachable ones\n"
        "  pytest-sky down --stale --kubernetes   # clusters of runners that vanished, from any machine\n"
        "  pytest-sky down --stale --slurm   # a killed session's allocations, found on the site",
    )
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("-a", "--all", action="store_true", help="every cluster in the state directory")
    p.add_argument(
        "--purge",
        action="store_true",
        help="forget a cluster whose backend cannot be reached (or fails to remove it), saying what may be left",
    )
    p.add_argument(
        "--stale",
        action="store_true",
        help="clusters whose owner is gone: this state directory's, and those the backend's site still holds for an "
        "owner gone anywhere (--kubernetes: the namespace's clusters whose lease expired; --slurm: allocations named "
        "as ours whose owner record names a dead process of this machine); never a kept or live one",
    )
    stale.add_where_options(p)
    _add_yes_option(p)
    p.set_defaults(func=cmd_down)


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


#: Each command's last positional, where words that follow an option go.  argparse fills a
#: command's positionals in one go at the first of them, so in `exec dev -d 'sleep 5'` (or
#: `logs dev -f 3`) the words after the option would be "unrecognized"; sky takes options
#: anywhere.
_TRAILING: dict[str, tuple[str, Callable[[str], object]]] = {
    "launch": ("task", str),
    "exec": ("task", str),
    "logs": ("jobs", str),
    "cancel": ("jobs", _positive_int),
    "ssh": ("node", str),
    "down": ("names", str),
    "stop": ("names", str),
    "start": ("names", str),
    "status": ("names", str),
}


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parse_args``, with options allowed between a command's positionals."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    dest, convert = _TRAILING.get(getattr(args, "subcommand", None) or "", ("", str))
    current = getattr(args, dest, None)
    one_more = current is None and len(extra) == 1
    if not dest or any(word.startswith("-") for word in extra) or not (isinstance(current, list) or one_more):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        values = [convert(word) for word in extra]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument {dest.upper()}: {exc}")
    setattr(args, dest, current + values if isinstance(current, list) else values[0])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    remote: list[str] | None = None
    if "--" in argv:
        # `... -- COMMAND...`: the command is the nodes', never ours to parse (options included).
        cut = argv.index("--")
        argv, remote = argv[:cut], argv[cut + 1 :]
    args = _parse(parser, argv)
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
        return job_report.EXIT_INTERRUPTED
    except BrokenPipeError:
        # `pytest-sky status --json | head`: the reader left; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> NoReturn:
    """The ``pytest-sky`` command (and ``python -m pytest_sky.cli``): :func:`main` in a process
    of its own, which no user code shares.

    paramiko imports ``invoke`` for one thing, an ssh_config's ``Match exec``, which pytest-sky
    never asks of it, and goes on without it where it is missing.  That import (with the
    ``unittest.mock``, ``asyncio`` and YAML it pulls in) was about a sixth of the CPU of every
    command that connects to a head (measured: ``queue`` 0.55 -> 0.46 CPU-seconds on a day
    this machine ran ~2.5x slower).  So this process marks it missing.  :func:`main` itself,
    which tests call in-process, leaves ``sys.modules`` alone."""
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]  # import invoke -> ImportError
    sys.exit(main())


if __name__ == "__main__":
    entry()
