"""A run's report, one HTML file opened from disk: `python -m rl2.report SAVE_DIR [SAVE_DIR ...]`.

Plots of every metric of `metrics.jsonl` against step, grouped (reward, lengths, policy, off-policy,
time, faults, ...; `test/` metrics in their group), one plot per group with a line per metric and run (several
folders overlay their runs), made with plotly and its JavaScript bundled into the page; and a browser over the
trajectory dumps (`trajectories/step_N.jsonl`, `test_step_N.jsonl`): pick a dump, filter by reward, env
error, truncation or text, and read each trajectory as its conversation, tool calls and tool answers set apart.

The page fetches nothing from the network. A run's dumps go in the page itself when they are small (a demo:
one file to send); beyond `--inline-mb` each dump becomes a script file in `report_files/` beside it, read
only when that dump is picked, so 1,000 steps x 1,024 trajectories never load at once. Plotly, not
hand-drawn SVG: zoom, hover and legends come with it, and its bundle works offline.

Written at the end of every training run as `<save_dir>/report.html`.
"""

import argparse
import html
import json
import os
import re
import sys

from rl2.metrics import read_metrics

INLINE_MB = 20.0
# Metric groups, first match wins: (title, pattern on the name without its "test/" prefix).
GROUPS = [
    ("reward", r"^(reward|score|avg@|pass@|accuracy|margin|rewards?/)"),
    ("lengths and turns", r"^(response_length|prompt_length|length|turns|truncat|overlong)"),
    ("throughput and counts", r"(tokens_per_second|loss_tokens|^trajectories$|^excluded$|^pairs$)"),
    ("policy: loss, entropy, KL, clipping", r"^(actor/|loss$|kl|entropy|clip|grad_norm|lr$)"),
    ("engine/trainer mismatch and off-policy", r"^(logp_mismatch|offpolicy/|partial/|async/)"),
    ("critic", r"^critic/"),
    ("time per phase", r"^(time/|step_time)"),
    ("faults and env errors", r"^(faults/|env_|unscored|error|roc/)"),
]
OTHER = "other"


def metric_group(name: str) -> str:
    """The plot a metric goes in."""
    bare = name.removeprefix("test/")
    for title, pattern in GROUPS:
        if re.search(pattern, bare):
            return title
    return OTHER


def grouped_metrics(runs: dict[str, list[dict]]) -> dict[str, list[str]]:
    """Group title -> metric names found in any run, in GROUPS order."""
    names = sorted({name for rows in runs.values() for row in rows for name in row if name != "step"})
    groups: dict[str, list[str]] = {title: [] for title, _ in GROUPS + [(OTHER, "")]}
    for name in names:
        groups[metric_group(name)].append(name)
    return {title: members for title, members in groups.items() if members}


def figures_html(runs: dict[str, list[dict]]) -> list[str]:
    """One plotly figure per metric group, as HTML without the plotly bundle."""
    import plotly.graph_objects as go

    parts = []
    for title, names in grouped_metrics(runs).items():
        figure = go.Figure()
        for run, rows in runs.items():
            for name in names:
                points = [(row["step"], row[name]) for row in rows if isinstance(row.get(name), (int, float))]
                if points:
                    label = name if len(runs) == 1 else f"{run}: {name}"
                    figure.add_trace(go.Scatter(x=[s for s, _ in points], y=[v for _, v in points], name=label,
                                                mode="lines+markers" if len(points) < 50 else "lines"))
        figure.update_layout(title=title, height=360, margin=dict(l=50, r=20, t=50, b=40), xaxis_title="step",
                             legend=dict(font=dict(size=10)))
        parts.append(figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{len(parts)}"))
    return parts


def dump_names(save_dir: str) -> list[str]:
    """The trajectory dumps of a run, training steps then evaluations, each by step."""
    folder = os.path.join(save_dir, "trajectories")
    if not os.path.isdir(folder):
        return []
    names = [name[:-6] for name in os.listdir(folder) if name.endswith(".jsonl")]
    number = lambda name: int(m.group(1)) if (m := re.search(r"(\d+)$", name)) else -1  # noqa: E731
    return sorted(names, key=lambda name: (name.startswith("test") or name == "eval", number(name), name))


def read_dump(save_dir: str, name: str) -> list[dict]:
    with open(os.path.join(save_dir, "trajectories", f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _script_json(value) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(value).replace("</", "<\\/")


def write_report(save_dirs: list[str], out: str | None = None, inline_mb: float = INLINE_MB) -> str:
    """Write the report of the runs in `save_dirs` (the first one's trajectories are browsed); its path."""
    import plotly.offline

    first = save_dirs[0]
    out = out or os.path.join(first, "report.html")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    runs = {os.path.basename(os.path.normpath(d)) or d: _metrics(d) for d in save_dirs}
    names = dump_names(first)
    sizes = {name: os.path.getsize(os.path.join(first, "trajectories", f"{name}.jsonl")) for name in names}
    inline = sum(sizes.values()) <= inline_mb * 2**20
    dumps_html = []
    if inline:
        for name in names:
            dumps_html.append(f'<script type="application/json" id="dump-{html.escape(name)}">'
                              f"{_script_json(read_dump(first, name))}</script>")
    else:
        folder = os.path.splitext(out)[0] + "_files"
        os.makedirs(folder, exist_ok=True)
        for name in names:
            with open(os.path.join(folder, f"{name}.js"), "w") as f:
                f.write(f"rl2Dump({_script_json(name)}, {_script_json(read_dump(first, name))});\n")
    page = PAGE.format(
        title=html.escape(", ".join(runs)),
        plotly=plotly.offline.get_plotlyjs(),
        summary=html.escape(_summary(runs)),
        plots="\n".join(f'<div class="plot">{part}</div>' for part in figures_html(runs)) or "<p>no metrics</p>",
        dumps=_script_json(names),
        files=_script_json(None if inline else os.path.basename(os.path.splitext(out)[0]) + "_files"),
        inline_dumps="\n".join(dumps_html),
        script=SCRIPT,
        style=STYLE,
    )
    with open(out, "w") as f:
        f.write(page)
    return out


def _metrics(save_dir: str) -> list[dict]:
    path = os.path.join(save_dir, "metrics.jsonl")
    return read_metrics(path) if os.path.exists(path) else []


def _summary(runs: dict[str, list[dict]]) -> str:
    parts = []
    for run, rows in runs.items():
        train = [row for row in rows if "reward/mean" in row]
        last = f", last reward/mean {train[-1]['reward/mean']:.3f}" if train else ""
        parts.append(f"{run}: {len(rows)} metric rows{last}")
    return "; ".join(parts)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 24px; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.plot { border: 1px solid #ddd; border-radius: 6px; padding: 4px; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin: 8px 0; }
.trajectory { border: 1px solid #ccc; border-radius: 6px; margin: 6px 0; padding: 6px 10px; }
.trajectory summary { cursor: pointer; }
.message { white-space: pre-wrap; margin: 6px 0; padding: 6px; border-radius: 4px; font-family: monospace; font-size: 12px; }
.role-system { background: #f3f3f3; } .role-user { background: #eef4ff; } .role-assistant { background: #f6fff0; }
.role-tool { background: #fff4e0; border-left: 4px solid #f0a020; margin-left: 24px; }
.tool-call { background: #ffe9c7; }
.error { color: #b00020; } .muted { color: #777; }
"""

SCRIPT = r"""
const loaded = {};
function rl2Dump(name, trajectories) { loaded[name] = trajectories; if (name === current()) render(); }
function current() { return document.getElementById('dump').value; }
function loadDump(name) {
  if (loaded[name]) { render(); return; }
  const inline = document.getElementById('dump-' + name);
  if (inline) { loaded[name] = JSON.parse(inline.textContent); render(); return; }
  const script = document.createElement('script');
  script.src = FILES + '/' + encodeURIComponent(name) + '.js';
  document.body.appendChild(script);
}
function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
}
function messageHtml(message) {
  let text = escapeHtml(typeof message.content === 'string' ? message.content : JSON.stringify(message.content));
  text = text.replace(/(&lt;(tool_call|search|code)&gt;[\s\S]*?&lt;\/\2&gt;)/g, '<span class="tool-call">$1</span>');
  // Native function calls: each as name(arguments) with its id; a tool message names the call it answers.
  const calls = (message.tool_calls || []).map(call => '<span class="tool-call">' + escapeHtml(call.function.name) +
    '(' + escapeHtml(JSON.stringify(call.function.arguments)) + ')</span> <span class="muted">' +
    escapeHtml(call.id || '') + '</span>');
  if (calls.length) text += (text ? '\n' : '') + calls.join('\n');
  const answers = message.role === 'tool' && (message.name || message.tool_call_id) ?
    ` <span class="muted">${escapeHtml(message.name || '')} ${escapeHtml(message.tool_call_id || '')}</span>` : '';
  return `<div class="message role-${escapeHtml(message.role)}"><b>${escapeHtml(message.role)}</b>${answers}\n${text}</div>`;
}
function matches(t, filters) {
  const reward = t.reward === null || t.reward === undefined ? NaN : t.reward;
  if (filters.min !== '' && !(reward >= Number(filters.min))) return false;
  if (filters.max !== '' && !(reward <= Number(filters.max))) return false;
  if (filters.errors && !(t.errors && t.errors.length)) return false;
  if (filters.truncated && !t.truncated) return false;
  if (filters.text && !JSON.stringify(t.messages).toLowerCase().includes(filters.text.toLowerCase())) return false;
  return true;
}
function render() {
  const list = document.getElementById('trajectories');
  const name = current();
  const trajectories = loaded[name];
  if (!trajectories) { list.innerHTML = '<p class="muted">loading…</p>'; return; }
  const filters = {min: document.getElementById('min').value, max: document.getElementById('max').value,
                   errors: document.getElementById('errors').checked, truncated: document.getElementById('truncated').checked,
                   text: document.getElementById('text').value};
  const shown = trajectories.filter(t => matches(t, filters));
  document.getElementById('count').textContent = `${shown.length} of ${trajectories.length} trajectories`;
  list.innerHTML = shown.slice(0, 200).map((t, i) => {
    const errors = t.errors && t.errors.length ? `<span class="error"> env error: ${escapeHtml(t.errors.join('; '))}</span>` : '';
    const reward = t.reward === null || t.reward === undefined ? 'none' : Number(t.reward).toFixed(3);
    return `<details class="trajectory" data-reward="${reward}"><summary>group ${t.group} · reward ${reward} · ` +
           `${t.response_length} tokens · ${t.turns} turn(s)${t.truncated ? ' · truncated' : ''}${errors}</summary>` +
           (t.messages || []).map(messageHtml).join('') + (t.answer !== undefined && t.answer !== null ?
           `<div class="muted">answer: ${escapeHtml(JSON.stringify(t.answer))}</div>` : '') + '</details>';
  }).join('') + (shown.length > 200 ? `<p class="muted">first 200 shown: filter to see others</p>` : '');
}
function init() {
  const select = document.getElementById('dump');
  select.innerHTML = DUMPS.map(name => `<option>${escapeHtml(name)}</option>`).join('');
  const params = new URLSearchParams(location.hash.slice(1));  // e.g. #dump=step_3&min=1
  if (params.get('dump')) select.value = params.get('dump');
  for (const key of ['min', 'max', 'text']) if (params.get(key) !== null) document.getElementById(key).value = params.get(key);
  for (const key of ['errors', 'truncated']) if (params.get(key)) document.getElementById(key).checked = true;
  for (const id of ['min', 'max', 'text']) document.getElementById(id).addEventListener('input', render);
  for (const id of ['errors', 'truncated']) document.getElementById(id).addEventListener('change', render);
  select.addEventListener('change', () => loadDump(current()));
  if (DUMPS.length) loadDump(current()); else document.getElementById('trajectories').innerHTML =
      '<p class="muted">no trajectory dumps (trainer.dump_trajectories)</p>';
}
"""

PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>rl2 report: {title}</title>
<style>{style}</style>
<script>{plotly}</script>
</head><body>
<h1>rl2 report: {title}</h1>
<p class="muted">{summary}</p>
<h2>Metrics</h2>
<div class="plots">{plots}</div>
<h2>Trajectories</h2>
<div class="controls">
  <label>dump <select id="dump"></select></label>
  <label>reward from <input id="min" size="5"> to <input id="max" size="5"></label>
  <label><input type="checkbox" id="errors"> env errors only</label>
  <label><input type="checkbox" id="truncated"> truncated only</label>
  <label>text <input id="text" size="20"></label>
  <span id="count" class="muted"></span>
</div>
<div id="trajectories"></div>
{inline_dumps}
<script>const DUMPS = {dumps}; const FILES = {files};
{script}
init();</script>
</body></html>
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl2.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("save_dirs", nargs="+", help="run folders (metrics.jsonl, trajectories/); the first one's "
                                                     "trajectories are browsed, every run's metrics overlaid")
    parser.add_argument("--out", help="the HTML file (default <first save_dir>/report.html)")
    parser.add_argument("--inline-mb", type=float, default=INLINE_MB,
                        help=f"dumps up to this size go in the page itself (default {INLINE_MB:g}); larger runs get "
                             "one script file per dump beside it, read when picked")
    args = parser.parse_args(argv)
    missing = [d for d in args.save_dirs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}")
    print(write_report(args.save_dirs, args.out, args.inline_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
