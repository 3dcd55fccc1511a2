"""Reading a hung rank's stacks: which frame is the user's, which library call it waits in,
and the summary a failure report shows (``pytest_sky.diagnosis``).

The dumps below are what faulthandler wrote, through the nodes' ``sitecustomize``, for real
processes of torch 2.13 on Python 3.11 (a gloo ``all_reduce`` whose peer sleeps; torchrun's
agent waiting for a second node at its c10d rendezvous); ``tests/test_stacks.py`` and the
smoke suite make such dumps afresh.
"""

from __future__ import annotations

from pytest_sky.diagnosis import (
    Capture,
    KernelThread,
    NodeView,
    ProcessView,
    RankState,
    called_on,
    is_library,
    module_of,
    parse_dump,
    waiting,
)

VENV = "/work/.venv/lib/python3.11/site-packages"
ALL_REDUCE = f"""\
Current thread 0x00007f895326eb80 (most recent call first):
  File "{VENV}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{VENV}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/sky/sky_workdir/hang.py", line 13 in main
  File "/home/sky/sky_workdir/hang.py", line 15 in <module>
"""
SLEEPING = """\
Thread 0x00007f34b86fd6c0 (most recent call first):
  File "/home/sky/sky_workdir/hang.py", line 3 in worker
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f1636469b80 (most recent call first):
  File "/home/sky/sky_workdir/hang.py", line 12 in main
  File "/home/sky/sky_workdir/hang.py", line 15 in <module>
"""
TORCHRUN = f"""\
Current thread 0x00007fbd42886b80 (most recent call first):
  File "{VENV}/torch/distributed/elastic/rendezvous/utils.py", line 181 in _delay
  File "{VENV}/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 685 in run
  File "{VENV}/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 1171 in next_rendezvous
  File "{VENV}/torch/distributed/elastic/agent/server/api.py", line 528 in _rendezvous
  File "{VENV}/torch/distributed/elastic/metrics/api.py", line 134 in wrapper
  File "{VENV}/torch/distributed/elastic/agent/server/api.py", line 713 in _initialize_workers
  File "{VENV}/torch/distributed/run.py", line 1028 in main
  File "/work/.venv/bin/torchrun", line 8 in <module>
"""
SOURCES = {
    "/home/sky/sky_workdir/hang.py:13": "dist.all_reduce(t)",
    "/home/sky/sky_workdir/hang.py:12": "time.sleep(600)",
    "/home/sky/sky_workdir/hang.py:3": "time.sleep(999)",
}


def test_the_user_frame_and_the_collective_of_a_gloo_all_reduce() -> None:
    (thread,) = parse_dump(ALL_REDUCE, SOURCES)
    assert thread.current and thread.ident == "0x00007f895326eb80"
    wait = waiting(thread)
    assert wait.user is not None and wait.user.where() == "hang.py:13 main"
    assert wait.user.source == "dist.all_reduce(t)"
    assert wait.call == "torch.distributed.all_reduce"  # the logging decorator passes it on


def test_a_call_into_c_is_read_from_the_users_own_line() -> None:
    worker, main = parse_dump(SLEEPING, SOURCES)
    assert (waiting(main).user.where(), waiting(main).call) == ("hang.py:12 main", "time.sleep")  # type: ignore[union-attr]
    assert waiting(worker).user.where() == "hang.py:3 worker"  # type: ignore[union-attr]
    assert called_on("comm.Barrier()") == "comm.Barrier"
    assert called_on("x = comm.allreduce(comm.Get_rank() + 1)") == "comm.allreduce"  # the outermost runs last
    assert called_on("    time.sleep(") == "time.sleep"  # the first line of a longer statement
    assert called_on("for batch in loader:") == ""
    assert called_on('import time; print("up"); time.sleep(600)') == "time.sleep"  # python -c's one line


def test_torchruns_agent_has_no_user_frame_and_waits_in_the_c10d_rendezvous() -> None:
    (thread,) = parse_dump(TORCHRUN)
    argv = ("/work/.venv/bin/python", "/work/.venv/bin/torchrun", "--nnodes=2", "--rdzv_backend=c10d", "train.py")
    dirs = ProcessView(1, 0, "S", "", argv).interpreter_dirs()
    wait = waiting(thread, dirs, argv)
    assert wait.user is None
    assert wait.call == "the c10d rendezvous (torch.distributed.elastic.rendezvous.dynamic_rendezvous.next_rendezvous)"
    assert waiting(thread, dirs, ("torchrun", "--rdzv-backend", "c10d")).call.startswith("the c10d rendezvous")


def test_what_counts_as_the_users_own_file() -> None:
    from pytest_sky.diagnosis import Frame

    def lib(path: str, dirs: tuple[str, ...] = ()) -> bool:
        return is_library(Frame(path, 1, "f"), dirs)

    assert lib(f"{VENV}/torch/nn/modules/module.py") and lib("/usr/lib/python3/dist-packages/mpi4py/run.py")
    assert lib("/usr/lib/python3.11/threading.py") and lib("<frozen importlib._bootstrap>")
    assert lib("/opt/venv/bin/torchrun", ("/opt/venv/bin",))
    assert not lib("/home/sky/sky_workdir/train.py") and not lib("<string>")  # python -c is the user's
    assert module_of(f"{VENV}/torch/distributed/__init__.py") == "torch.distributed"
    assert module_of("/usr/lib/python3.11/concurrent/futures/thread.py") == "concurrent.futures.thread"


def test_the_summary_reads_in_ten_seconds() -> None:
    python = ProcessView(
        812, 800, "S", "futex_wait_queue", ("python3", "hang.py"),
        threads=(KernelThread(812, "python3", "S", "futex_wait_queue"),), python=True,
        stacks=parse_dump(ALL_REDUCE, SOURCES),
    )  # fmt: skip
    bash = ProcessView(800, 790, "S", "do_wait", ("/bin/bash", "-c", "<812 characters>"))
    ranks = (
        RankState(0, "head", "198.18.0.2", "run", True, None, ("rank 0 ready", "joining")),
        RankState(1, "worker1", "198.18.0.3", "run", True, 0, ("done",)),
        RankState(2, "worker2", "198.18.0.4", "run", False, None),
    )
    nodes = (NodeView(0, (bash, python)), NodeView(1), NodeView(2, error="ssh exit 255: connection refused"))
    text = Capture("c", 3, "at the deadline (20 s)", 0.0, 0.4, ranks, nodes).summary()
    assert text.splitlines() == [
        "where every rank of job 3 on c was at the deadline (20 s):",
        "rank 0 (head, 198.18.0.2): running",
        "  pid 812 python3 hang.py [S, in futex_wait_queue]",
        "    main thread: hang.py:13 main: dist.all_reduce(t)",
        "      waits in torch.distributed.all_reduce",
        "  last lines:",
        "    | rank 0 ready",
        "    | joining",
        "rank 1 (worker1, 198.18.0.3): exited (0)",
        "  last lines:",
        "    | done",
        "rank 2 (worker2, 198.18.0.4): never started",
        "  could not look at its node: ssh exit 255: connection refused",
    ]
    full = Capture("c", 3, "at the deadline (20 s)", 0.0, 0.4, ranks, nodes).full()
    assert '      File "/home/sky/sky_workdir/hang.py", line 13 in main\n        dist.all_reduce(t)' in full
    assert "    command: /bin/bash -c <812 characters>" in full
    assert "task 812 'python3' [S, in futex_wait_queue]" in full
