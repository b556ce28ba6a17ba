"""code-judge's own test suite (`tests/test_main.py` of github.com/0xWJ/code-judge), unchanged,
against rl2's code server on loopback, when a code-judge checkout is given:

    RL2_CODE_JUDGE=/path/to/code-judge python -m pytest tests/test_code_judge_suite.py

code-judge publishes no licence, so its tests are not copied into this repository; each behaviour
they check also has a test of ours in tests/test_code_service.py and tests/test_sandbox.py. The
run takes about 90 s (its timeouts are code-judge's 10 s), which is why it is not in the default suite.
"""

import os
import shutil
import subprocess
import sys

import pytest

from server_process import REPO, ServerProcess, python_env

CHECKOUT = os.environ.get("RL2_CODE_JUDGE")


@pytest.mark.skipif(not CHECKOUT, reason="set RL2_CODE_JUDGE to a code-judge checkout to run its own suite")
def test_code_judge_suite_passes_unchanged(tmp_path):
    shutil.copy(os.path.join(CHECKOUT, "tests", "test_main.py"), tmp_path / "test_main.py")
    shutil.copy(os.path.join(REPO, "tests", "clients", "code_judge_conftest.py"), tmp_path / "conftest.py")
    # code-judge's test configuration: 4 workers, a 10 s limit per program
    server = ServerProcess("rl2.tools.code_server", ["--port", "0", "--workers", "4", "--timeout", "10"],
                           r"code service ready at (http://\S+)", "code server")
    try:
        url = server.wait_ready()
        suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                str(tmp_path)], cwd=tmp_path, env={**python_env(), "RL2_CODE_SERVER_URL": url},
                               capture_output=True, text=True, timeout=600)
    finally:
        assert server.stop() == 0, server.log()
    assert suite.returncode == 0, suite.stdout[-5000:] + suite.stderr[-2000:]
    assert "31 passed" in suite.stdout
