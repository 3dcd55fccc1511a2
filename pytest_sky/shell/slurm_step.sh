#!/bin/bash
# How a rank of a Slurm cluster of pytest-sky's starts, inside its job step (srun ... bash -c
# SCRIPT slurm-step COMMAND...): the step's own Slurm variables go (SLURM_NNODES=1,
# SLURM_NTASKS=1, its step id, its node list...), which would hold a user's own srun to this
# one step's node and task; the allocation's stay (its id, user, partition, cluster), and
# the backend exports its node list and count with the rest of the rank's environment.
# SLURM_JOBID goes too, Slurm's old spelling of SLURM_JOB_ID (srun reads the new one): it is
# what OpenMPI's mpirun looks for to launch through srun on the allocation's nodes by name,
# where the hosts it is given (SKYPILOT_NODE_IPS) are addresses; without it mpirun goes over
# the cluster's ssh, as on every backend.  Then COMMAND (the rank's supervisor) takes over.
for v in $(compgen -e); do
  case $v in
    SLURM_JOB_ID | SLURM_JOB_USER | SLURM_JOB_UID | SLURM_JOB_GID | SLURM_JOB_PARTITION) ;;
    SLURM_JOB_ACCOUNT | SLURM_JOB_QOS | SLURM_CLUSTER_NAME | SLURM_CONF | SLURM_WORKING_CLUSTER) ;;
    SLURM_*) unset "$v" ;;
  esac
done
exec "$@"
