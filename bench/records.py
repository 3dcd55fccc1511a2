"""The benchmark's records: one :class:`Figure` per printed row, plus the machine it ran on.

Kept as plain dataclasses so the same objects feed the text table, the JSON file and the
docs' performance table without any of them re-deriving ratios or verdicts on its own.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone


@dataclass(frozen=True)
class Target:
    """A bound a figure must meet; ``source`` says who set it (DESIGN.md section 7 or the issue)."""

    limit: float
    source: str
    at_least: bool = False  # counts (successes) must reach the limit; times must stay under it
    on_ratio: bool = False  # judged on value / baseline (bandwidth against loopback)

    def met(self, value: float) -> bool:
        return value >= self.limit if self.at_least else value <= self.limit


@dataclass
class Figure:
    """One measured quantity, its same-run baseline and the targets it is judged against.

    ``value`` and ``baseline`` are in ``unit`` (``s``, ``ms`` or ``count``); the raw samples
    are kept so the JSON file can answer "was the median hiding an outlier?".
    """

    section: str
    name: str
    unit: str
    value: float | None
    baseline: float | None = None
    baseline_name: str = ""
    targets: list[Target] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    baseline_samples: list[float] = field(default_factory=list)
    total: int | None = None  # for counts: out of how many
    note: str = ""
    error: str | None = None  # the measurement itself failed

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.baseline:
            return None
        return self.value / self.baseline

    def verdicts(self) -> list[tuple[Target, bool]]:
        if self.value is None:
            return [(t, False) for t in self.targets]
        return [(t, t.met(self.ratio if t.on_ratio and self.ratio is not None else self.value)) for t in self.targets]

    @property
    def passed(self) -> bool | None:
        """None when there is nothing to judge against; False when the measurement failed."""
        if self.error is not None:
            return False
        if not self.targets:
            return None
        return all(ok for _, ok in self.verdicts())

    def to_json(self) -> dict:
        data = asdict(self)
        data["ratio"] = self.ratio
        data["passed"] = self.passed
        return data


@dataclass(frozen=True)
class Machine:
    """What the numbers were measured on: they mean little without it."""

    uname: str
    cpus: int
    memory_gib: float
    loadavg: str  # at the start: other engineers' tests share this machine
    date_utc: str
    loadavg_end: str = ""  # filled in after the run: a busy machine shows in both

    @classmethod
    def detect(cls) -> Machine:
        u = platform.uname()
        return cls(
            uname=f"{u.system} {u.release} {u.machine}",
            cpus=os.cpu_count() or 1,
            memory_gib=_mem_total_gib(),
            loadavg=_loadavg(),
            date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        )

    def describe(self) -> str:
        load = f"load {self.loadavg} at start" + (f", {self.loadavg_end} at end" if self.loadavg_end else "")
        return f"{self.uname}, {self.cpus} CPUs, {self.memory_gib:.1f} GiB RAM, {load}, {self.date_utc}"

    def finished(self) -> Machine:
        return replace(self, loadavg_end=_loadavg())


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return 0.0


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def percentile(xs: list[float], p: int) -> float | None:
    """Inclusive-method percentile; with one sample that sample is every percentile."""
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]
