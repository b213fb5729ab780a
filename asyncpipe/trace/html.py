"""A self-contained HTML page of a recorded run: summary table and timeline pictures."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from .run import StageSummary

__all__: list[str] = []

_STYLE = """
body { font-family: DejaVu Sans, Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 12px 0 24px; }
th, td { padding: 4px 12px; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.timeline { margin: 12px 0; overflow-x: auto; }
.timeline svg { max-width: 100%; height: auto; }
.note { color: #777; }
"""

# Counts the rows of the measured timeline once the page has loaded; a script error leaves
# data-status at "error", so a headless browser can check both.
_SCRIPT = """
window.addEventListener("error", function () { document.body.dataset.status = "error"; });
window.addEventListener("load", function () {
  var measured = document.querySelector(".timeline.measured svg");
  var rows = measured ? measured.querySelectorAll("rect.idle").length : 0;
  document.body.dataset.rows = String(rows);
  document.getElementById("rows").textContent = rows + " ranks";
  if (document.body.dataset.status !== "error") { document.body.dataset.status = "ok"; }
});
"""


def page(
    title: str, lines: Sequence[str], summary: Sequence[StageSummary], svgs: Sequence[str]
) -> str:
    """The HTML document: a heading, summary lines, a per-rank table and the SVG timelines
    (the first is the measured step, the second, if any, the simulated ideal)."""
    rows = "\n".join(
        f"<tr><td>rank {s.rank}</td><td>{s.busy:.1%}</td><td>{s.communication:.1%}</td>"
        f"<td>{s.idle:.1%}</td><td>{s.peak_memory / 2**20:.0f}</td></tr>"
        for s in summary
    )
    pictures = "\n".join(
        f'<div class="timeline {"measured" if n == 0 else "ideal"}">{svg}</div>'
        for n, svg in enumerate(svgs)
    )
    notes = "".join(f"<p>{escape(line)}</p>" for line in lines)
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{escape(title)}</title><style>{_STYLE}</style></head>
<body data-status="loading">
<h1>{escape(title)}</h1>
{notes}
<p class="note" id="rows"></p>
<table>
<tr><th>rank</th><th>busy</th><th>communication</th><th>idle (bubble)</th><th>peak MiB</th></tr>
{rows}
</table>
{pictures}
<script>{_SCRIPT}</script>
</body>
</html>
"""
