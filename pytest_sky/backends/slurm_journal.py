"""What the Slurm backend writes down about a cluster, before it submits anything.

``destroy`` in a later process (the reaper, ``pytest-sky down``) reads only this: which site
(its SSH config and Host), whose jobs (the user there), which job (its name, the launch's
token in its comment and, once sbatch answered, its id).  A launch killed between sbatch and
writing the id leaves the name and token, by which the job is still found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytest_sky.backends.slurm_site import Site
from pytest_sky.state import Journal


@dataclass(frozen=True)
class SlurmRecord:
    config: str | None = None  # the site's SSH config (None: this machine is the login node)
    host: str | None = None
    user: str = ""  # who the jobs run as on the site (``id -un`` on its login node)
    job_name: str = ""  # written before sbatch; "": nothing was submitted
    launch: str = ""  # the launch's token: in the job's comment (``slurm_owner``)
    job_id: str | None = None  # once sbatch answered
    node_dir: str = ""  # the cluster's directory on each node

    @property
    def site(self) -> Site:
        return Site(self.config, self.host)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "host": self.host,
            "user": self.user,
            "job_name": self.job_name,
            "launch": self.launch,
            "job_id": self.job_id,
            "node_dir": self.node_dir,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlurmRecord:
        return cls(
            config=data.get("config") or None,
            host=data.get("host") or None,
            user=data.get("user") or "",
            job_name=data.get("job_name") or "",
            launch=data.get("launch") or "",
            job_id=data.get("job_id") or None,
            node_dir=data.get("node_dir") or "",
        )

    @classmethod
    def load(cls, journal: Journal) -> SlurmRecord:
        return cls.from_json(journal.load())

    def save(self, journal: Journal) -> None:
        """Durable before returning (intent before action)."""
        journal.update(**self.to_json())
