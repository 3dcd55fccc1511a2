"""Each MPI rank contributes ``rank + 1``; an allreduce must give every rank n(n+1)/2.

Run by ``mpirun`` across every node of the cluster (see allreduce.yaml).  Every MPI rank
prints one line with the node it ran on, so a test can check that the ranks really spread
over all nodes and that each of them saw the right sum; a wrong sum exits non-zero, which
makes mpirun, and so the task, fail.
"""

from __future__ import annotations

import sys

from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    total = comm.allreduce(rank + 1, op=MPI.SUM)
    expected = size * (size + 1) // 2
    ok = total == expected
    # One write per line: mpirun merges every rank's stdout into its own.
    sys.stdout.write(
        f"MPI rank={rank} size={size} host={MPI.Get_processor_name()} sum={total} expected={expected} ok={int(ok)}\n"
    )
    sys.stdout.flush()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
