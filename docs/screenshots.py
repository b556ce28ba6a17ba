"""Screenshots of a run's report for the docs, taken in headless Chromium (as tests/test_report.py opens the page).

    python docs/screenshots.py RUN_DIR [--out docs/images]      # make docs-screenshots: the tool demo's run

writes `report.png` (the top of the report: the summary and the first plots) and `trajectory.png` (the trajectory
browser at the run's last step, a rewarded trajectory opened) from `RUN_DIR/report.html` (made first if missing).
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Shown in the trajectory screenshot only: the plots hidden, the first listed trajectory opened.
OPEN_FIRST_TRAJECTORY = """<script>
window.addEventListener('load', () => setTimeout(() => {
  document.querySelector('.plots').style.display = 'none';
  document.querySelector('h2').style.display = 'none';  // "Metrics"
  const first = document.querySelector('details.trajectory');
  if (first) first.open = true;
}, 300));
</script>"""


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def screenshot(chromium: str, url: str, out: str, width: int, height: int, profile: str) -> None:
    """A headless screenshot of `url`, nothing fetched but the page's own file."""
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--virtual-time-budget=5000", f"--window-size={width},{height}", "--hide-scrollbars",
            "--disable-background-networking", "--no-first-run", f"--user-data-dir={profile}", f"--screenshot={out}", url]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if result.returncode != 0 or not os.path.isfile(out):
        raise RuntimeError(f"chromium failed on {url}: {result.stderr[-2000:]}")


def last_step(run_dir: str) -> str:
    """The name of the run's last training dump (`step_N`)."""
    steps = [int(m.group(1)) for path in glob.glob(os.path.join(run_dir, "trajectories", "step_*.jsonl"))
             if (m := re.search(r"step_(\d+)\.jsonl$", path))]
    if not steps:
        raise ValueError(f"{run_dir} has no trajectories/step_N.jsonl")
    return f"step_{max(steps)}"


def take_screenshots(run_dir: str, out_dir: str, chromium: str) -> list[str]:
    """`report.png` and `trajectory.png` of `run_dir`'s report in `out_dir`; their paths."""
    page = os.path.join(run_dir, "report.html")
    if not os.path.isfile(page):
        subprocess.run([sys.executable, "-m", "rl2.report", run_dir], check=True, cwd=REPO)
    os.makedirs(out_dir, exist_ok=True)
    shots = [os.path.join(out_dir, "report.png"), os.path.join(out_dir, "trajectory.png")]
    with tempfile.TemporaryDirectory(prefix="rl2-shots-") as folder:
        screenshot(chromium, f"file://{os.path.abspath(page)}", shots[0], 1280, 1000, os.path.join(folder, "a"))
        opened = os.path.join(os.path.dirname(os.path.abspath(page)), ".report_trajectory_view.html")
        try:  # beside the report, so that its side files (report_files/) load as they do for the report
            with open(page) as f:
                html = f.read()
            with open(opened, "w") as f:
                f.write(html.replace("</body>", OPEN_FIRST_TRAJECTORY + "</body>"))
            screenshot(chromium, f"file://{opened}#dump={last_step(run_dir)}&min=1", shots[1], 1280, 560,
                       os.path.join(folder, "b"))
        finally:
            os.remove(opened)
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run folder (report.html, trajectories/)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "images"), help="where the PNGs go")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("no Chromium: apt-get install chromium", file=sys.stderr)
        return 2
    for path in take_screenshots(args.run_dir, args.out, chromium):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
