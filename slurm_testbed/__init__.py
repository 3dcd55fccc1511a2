"""A real Slurm cluster on this machine, for testing pytest-sky's Slurm backend without a site.

Test infrastructure, as the Kubernetes emulator is: pytest-sky never imports it.  Debian 12's
Slurm 22.05 (slurmctld, slurmd, the client commands) and munge run inside pytest-sky local
nodes: rank 0 is the controller and the login node, reached over SSH as a site's login node
is, and every other rank a compute node.  Layout:

- ``config.py``: the shape of the testbed and the files it writes (``slurm.conf``,
  ``cgroup.conf``, ``gres.conf``, the login node's SSH config entry);
- ``node.sh``: what runs on each node (preparing it, each daemon, the readiness waits);
- ``testbed.py``: bringing it up and down;
- ``product.py``: the one module that imports ``pytest_sky`` (its public API).

Layers, lowest first (``tests/test_layering.py`` checks them):

0. config, product
1. testbed
2. slurm_testbed, __main__

Run it as a process with ``python -m slurm_testbed --nodes N --slurm-config FILE``.
"""
