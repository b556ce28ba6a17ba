"""The tests' forked-rank launcher: it forks from a single-threaded server, and a forked run that
dies by a signal is run again under the real launcher."""

import pytest

import rank_launcher
from conftest import FORK_RANKS, run_python, run_torchrun

pytestmark = pytest.mark.skipif(not FORK_RANKS, reason="RL2_FORK_RANKS=0: ranks are not forked")


def test_the_forkserver_has_no_thread_but_its_own():
    """A thread running while the server forks (pyarrow's jemalloc background thread was one) leaves
    forked ranks with its locks held: the preloaded server must be single-threaded."""
    assert len(rank_launcher.server_threads()) == 1, rank_launcher.server_threads()


def test_a_forked_run_killed_by_a_signal_runs_again_under_the_real_launcher():
    # Only the forked process has the trainers preloaded: it crashes, the real interpreter does not.
    code = ("import os, signal, sys\n"
            "if 'rl2.trainer.ppo' in sys.modules:\n"
            "    os.kill(os.getpid(), signal.SIGSEGV)\n"
            "print('ran under the real interpreter')\n")
    with pytest.warns(UserWarning, match="died by signal 11"):
        result = run_python(["-c", code])
    assert "ran under the real interpreter" in result.stdout


def test_a_failed_run_names_the_rank_that_failed_first():
    """A rank that exits non-zero without a word is named, with how every rank ended (torchrun's summary)."""
    code = ("import os, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    os._exit(3)\n"
            "time.sleep(60)\n")
    result = run_torchrun(["-c", code], check=False)
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "rank_launcher: rank 1 failed first (rank 0: killed by SIGTERM, rank 1: exit code 3)"), result.stderr
