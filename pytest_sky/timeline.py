"""A failed run's timeline as one self-contained HTML page: a row per rank, a bar per phase.

What a person looking at a failed multinode test in CI wants first is which rank died or hung,
and when, relative to the others.  So each rank's setup and run are drawn against one time
axis, coloured by how they ended; a rank that never started and one still running when the
run timed out are drawn differently and say so in words, a dashed line marks the deadline
(or the moment the run was stopped) with the ranks still running then, and the first rank to
fail is named in the title.  Inline SVG and CSS only: it renders from an artifacts directory in any browser,
offline, and nothing in it is fetched.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from pytest_sky.runner import RankSpan, Timeline

_ROW = 34
_LEFT = 250
_WIDTH = 900
_TOP = 56
_COLOURS = {"ok": "#3c9a5f", "failed": "#d0342c", "running": "#e8a33d", "never": "#9aa0a6"}


def state(span: RankSpan) -> str:
    """How a phase of a rank ended: ok, failed, running (at the timeout) or never (started)."""
    if span.started is None and span.ended is None:
        return "never"
    if span.ended is None:
        return "running"
    return "ok" if span.code == 0 else "failed"


def _label(span: RankSpan) -> str:
    return {
        "ok": f"{span.phase}: exit 0",
        "failed": f"{span.phase}: exit {span.code}",
        "running": f"{span.phase}: still running at the timeout",
        "never": f"{span.phase}: never started",
    }[state(span)]


def _bar(span: RankSpan, y: int, t0: float, scale: float, end: float) -> str:
    kind = state(span)
    start = span.started if span.started is not None else t0
    stop = span.ended if span.ended is not None else end
    x = _LEFT + (start - t0) * scale
    w = max(3.0, (stop - start) * scale)
    if kind == "never":
        x, w = _LEFT, _WIDTH
    title = html.escape(f"rank {span.rank} {_label(span)} ({stop - start:.2f} s)")
    style = ' fill-opacity="0.35" stroke-dasharray="4 3" stroke="#555"' if kind in ("never", "running") else ""
    return (
        f'<rect class="{kind}" x="{x:.1f}" y="{y + 6}" width="{w:.1f}" height="{_ROW - 12}" '
        f'fill="{_COLOURS[kind]}"{style}><title>{title}</title></rect>'
    )


def render(timeline: Timeline, *, test_id: str = "") -> str:
    """The page for ``timeline``."""
    ranks = sorted({(s.rank, s.name, s.ip) for s in timeline.spans})
    t0 = min([s.started for s in timeline.spans if s.started is not None] + [timeline.started])
    end = max([s.ended for s in timeline.spans if s.ended is not None] + [timeline.ended])
    scale = _WIDTH / max(end - t0, 1e-3)
    rows = []
    for i, (rank, name, ip) in enumerate(ranks):
        y = _TOP + i * _ROW
        spans = [s for s in timeline.spans if s.rank == rank]
        words = "; ".join(_label(s) for s in spans)
        rows.append(f'<text x="8" y="{y + _ROW / 2 + 4}">rank {rank} ({html.escape(name)}, {html.escape(ip)})</text>')
        rows += [_bar(s, y, t0, scale, end) for s in spans]
        rows.append(f'<text class="words" x="{_LEFT + _WIDTH + 10}" y="{y + _ROW / 2 + 4}">{html.escape(words)}</text>')
    height = _TOP + len(ranks) * _ROW + 30
    axis = _axis(end - t0, scale, _TOP + len(ranks) * _ROW)
    marks = _deadline(timeline, t0, scale, _TOP + len(ranks) * _ROW)
    return _page(timeline, test_id, _headline(timeline), "\n".join([*rows, *axis, *marks]), height)


def _deadline(timeline: Timeline, t0: float, scale: float, y: int) -> list[str]:
    """A line where the run was stopped (its deadline, or an interrupt), naming the ranks
    still running then: where to look first."""
    if timeline.deadline is None:
        return []
    x = _LEFT + (timeline.deadline - t0) * scale
    running = sorted({s.rank for s in timeline.spans if state(s) == "running"})
    words = "deadline" + (f": still running: {', '.join(f'rank {r}' for r in running)}" if running else "")
    return [
        f'<line class="deadline" x1="{x:.1f}" y1="{_TOP - 18}" x2="{x:.1f}" y2="{y}" stroke="#b3261e" '
        'stroke-width="2" stroke-dasharray="6 3"/>',
        f'<text class="deadline" x="{x:.1f}" y="{_TOP - 22}" text-anchor="end" fill="#b3261e">'
        f"{html.escape(words)} ({timeline.deadline - t0:.2f} s)</text>",
    ]


def _headline(timeline: Timeline) -> str:
    first = timeline.first_failure()
    if first is not None:
        return f"rank {first.rank} ({first.name}) failed first: {first.phase} exited {first.code}"
    hung = [s for s in timeline.spans if state(s) == "running"]
    if timeline.timed_out and hung:
        names = ", ".join(f"rank {s.rank} ({s.name})" for s in hung)
        return f"timed out; still running: {names}"
    return "every rank ended with exit 0" if not timeline.timed_out else "timed out"


def _axis(seconds: float, scale: float, y: int) -> Sequence[str]:
    ticks = []
    step = max(seconds / 6, 1e-3)
    for i in range(7):
        t = i * step
        x = _LEFT + t * scale
        ticks.append(f'<line x1="{x:.1f}" y1="{_TOP - 6}" x2="{x:.1f}" y2="{y}" stroke="#ddd"/>')
        ticks.append(f'<text class="tick" x="{x:.1f}" y="{y + 16}">{t:.2f} s</text>')
    return ticks


def _page(timeline: Timeline, test_id: str, headline: str, body: str, height: int) -> str:
    title = html.escape(f"{test_id or timeline.cluster}: job {timeline.job_id}")
    legend = " ".join(
        f'<span class="key" style="background:{c}"></span>{html.escape(k)}'
        for k, c in (("exit 0", _COLOURS["ok"]), ("failed", _COLOURS["failed"]),
                     ("running at the timeout", _COLOURS["running"]), ("never started", _COLOURS["never"]))
    )  # fmt: skip
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px sans-serif; margin: 16px; }}
h1 {{ font-size: 18px; }} h2 {{ font-size: 16px; color: #b3261e; }}
svg text {{ font: 13px sans-serif; }} svg text.tick {{ font-size: 11px; fill: #555; text-anchor: middle; }}
.key {{ display: inline-block; width: 14px; height: 14px; margin: 0 4px 0 12px; vertical-align: middle; }}
</style></head>
<body>
<h1>{title} on cluster {html.escape(timeline.cluster)}</h1>
<h2 id="headline">{html.escape(headline)}</h2>
<p>{legend}</p>
<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 420}" height="{height}">
{body}
</svg>
</body></html>
"""
