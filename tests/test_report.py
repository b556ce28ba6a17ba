"""`python -m rl2.report`: metric groups, the page in headless Chromium (plots drawn, the trajectory browser
listing and filtering a step's trajectories, nothing fetched from the network), dumps in side files for
large runs, and the report written at the end of a run."""

import json
import os
import re
import shutil
import subprocess

import pytest

from rl2.report import grouped_metrics, main, metric_group, write_report

METRICS = ["reward/mean", "response_length/mean", "turns/mean", "actor/loss", "actor/entropy", "kl",
           "logp_mismatch/mean", "time/rollout", "faults/env_retries", "test/reward_mean"]


def fake_run(folder, steps: int = 6, per_step: int = 12) -> str:
    """A run folder as a trainer writes it: metrics.jsonl and trajectories/step_N.jsonl (and a test dump)."""
    os.makedirs(folder / "trajectories")
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, **{name: step * 0.1 + i for i, name in enumerate(METRICS)}}) + "\n")
    for step in range(1, steps + 1):
        with open(folder / "trajectories" / f"step_{step}.jsonl", "w") as f:
            for i in range(per_step):
                f.write(json.dumps({
                    "group": i // 4, "answer": "7", "reward": float(i % 3 == 0), "turns": 2,
                    "response_length": 10 + i, "truncated": i == 5, "errors": ["reward_fn: boom"] if i == 7 else [],
                    "messages": [{"role": "user", "content": f"question {i}"},
                                 {"role": "assistant", "content": f"<tool_call>lookup {i}</tool_call>"},
                                 {"role": "tool", "content": f"code {i}"},
                                 {"role": "assistant", "content": "", "tool_calls": [  # a native call
                                     {"id": "call_1", "type": "function",
                                      "function": {"name": "add", "arguments": {"a": i, "b": 1}}}]},
                                 {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": str(i + 1)},
                                 {"role": "assistant", "content": f"the answer is \\boxed{{{i}}}"}],
                }) + "\n")
    shutil.copy(folder / "trajectories" / "step_2.jsonl", folder / "trajectories" / "test_step_2.jsonl")
    return str(folder)


def test_metrics_are_grouped():
    assert metric_group("reward/mean") == metric_group("test/reward_mean") == "reward"
    assert metric_group("actor/entropy") == metric_group("kl") == "policy: loss, entropy, KL, clipping"
    assert metric_group("logp_mismatch/max") == metric_group("async/staleness") == "engine/trainer mismatch and off-policy"
    assert metric_group("time/rollout") == "time per phase" and metric_group("faults/env_retries") == "faults and env errors"
    assert metric_group("something/new") == "other"
    groups = grouped_metrics({"run": [{"step": 1, **{name: 0.0 for name in METRICS}}]})
    assert sorted(name for names in groups.values() for name in names) == sorted(METRICS)


def rendered(dom: str) -> int:
    """How many trajectories the browser lists (the page's script holds the template, with no number)."""
    return len(re.findall(r'<details class="trajectory" data-reward="[0-9n]', dom))


@pytest.fixture(scope="module")
def chromium() -> str:
    """Chromium's path, installed from Debian's packages when missing and possible (once); else the browser
    tests are skipped with the reason."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-qq", "chromium"]
        for commands in ([install], [["apt-get", "update", "-qq"], install]):
            try:
                for command in commands:
                    subprocess.run(command, capture_output=True, timeout=300, env=env)
            except subprocess.TimeoutExpired:
                break
            found = shutil.which("chromium")
            if found:
                break
    if found is None:
        pytest.skip("no Chromium, and it cannot be installed here (apt-get install chromium needs root and apt)")
    return found


def browse(chromium: str, page: str, tmp_path, hash_: str = "", screenshot: str | None = None) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, in headless Chromium, and the http(s) URLs it requested."""
    os.makedirs(tmp_path, exist_ok=True)
    net_log = tmp_path / "net.json"
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--virtual-time-budget=5000", f"--log-net-log={net_log}", "--window-size=1280,2400",
            "--disable-background-networking", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    result = subprocess.run(args + [f"file://{page}{hash_}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # Chromium's NetLog: each request's start names its URL and the origin that asked for it; a file:// page's
    # own requests have the opaque origin "null", the browser's own traffic (updates, time) "not an origin".
    text = net_log.read_text().rstrip()
    events = json.loads(text if text.endswith("}") else text.rstrip(",") + "]}")["events"]
    requested = {event["params"]["url"] for event in events
                 if event.get("params", {}).get("initiator", "not an origin") != "not an origin" and "url" in event["params"]}
    return result.stdout, sorted(url for url in requested if not url.startswith(("file:", "data:")))


def test_report_renders_lists_and_filters_offline(chromium, tmp_path):
    run = fake_run(tmp_path / "run")
    page = write_report([run])
    assert page == os.path.join(run, "report.html")
    dom, requested = browse(chromium, page, tmp_path / "browser_a", "#dump=step_3")
    assert requested == []  # nothing left the page
    groups = len(grouped_metrics({"run": [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]}))
    assert dom.count('class="plot"') == groups and dom.count("js-plotly-plot") >= groups  # each group drawn
    assert rendered(dom) == 12 and "12 of 12 trajectories" in dom
    assert '<div class="message role-tool"><b>tool</b>' in dom and '<span class="tool-call">' in dom  # tool calls and answers set apart
    assert '<span class="tool-call">add({"a":3,"b":1})</span> <span class="muted">call_1</span>' in dom  # native calls
    assert '<b>tool</b> <span class="muted">add call_1</span>' in dom
    filtered, _ = browse(chromium, page, tmp_path / "browser_b", "#dump=step_3&min=1")
    assert rendered(filtered) == 4 and "4 of 12 trajectories" in filtered
    errors, _ = browse(chromium, page, tmp_path / "browser_c", "#dump=step_3&errors=1")
    assert rendered(errors) == 1 and "reward_fn: boom" in errors
    text, _ = browse(chromium, page, tmp_path / "browser_d", "#dump=test_step_2&text=question%2011")
    assert rendered(text) == 1

    from PIL import Image

    shot = str(tmp_path / "shot.png")
    browse(chromium, page, tmp_path / "browser_e", "#dump=step_1", screenshot=shot)
    image = Image.open(shot).convert("L")
    low, high = image.getextrema()
    assert high - low > 100 and len(set(image.resize((64, 128)).getdata())) > 20  # not blank


def test_large_runs_read_each_dump_only_when_picked(chromium, tmp_path):
    run = fake_run(tmp_path / "run", steps=3)
    page = write_report([run], str(tmp_path / "out" / "big.html"), inline_mb=0)
    files = sorted(os.listdir(tmp_path / "out" / "big_files"))
    assert files == ["step_1.js", "step_2.js", "step_3.js", "test_step_2.js"]
    assert "question 11" not in open(page).read()  # not in the page: in the side files
    dom, requested = browse(chromium, page, tmp_path / "browser", "#dump=step_2&min=1")
    assert requested == [] and rendered(dom) == 4


def test_several_runs_overlay_and_the_command_line(tmp_path, capsys):
    first, second = fake_run(tmp_path / "a"), fake_run(tmp_path / "b")
    assert main([first, second, "--out", str(tmp_path / "both.html")]) == 0
    text = open(tmp_path / "both.html").read()
    assert '"name":"a: reward\\u002fmean"' in text and '"name":"b: reward\\u002fmean"' in text  # plotly's JSON
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing")])
    assert "no metrics.jsonl" in capsys.readouterr().err
