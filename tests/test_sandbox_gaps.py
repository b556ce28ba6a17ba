"""The sandbox holds in every mode (issue 65 item 12): bubblewrap, the default, against each gap the uid
mode leaves (files planted in /run/lock or /dev/shm, the host's unix sockets, other runs' files and the
checkout, other processes' command lines, filling /dev/shm); the uid mode only when asked for, with a
warning naming what it does not contain, and cleaning what its uid left in /run/lock."""

import errno
import logging
import os
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from rl2.tools import sandbox as sandbox_module
from rl2.tools.sandbox import FALLBACK_ENV, Sandbox, SandboxError, bwrap_works

ROOT = os.geteuid() == 0
UID_BASE = 611000  # not test_sandbox.py's
pytestmark = pytest.mark.xdist_group("sandbox_uids")
needs_bwrap = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or unusable here")


@pytest.fixture(scope="module")
def bwrap_box():
    if not bwrap_works():
        pytest.skip("bubblewrap missing or unusable here")
    with Sandbox(workers=1, isolation="bwrap", timeout=5.0, uid_base=UID_BASE, tmpfs_mb=32, file_size_mb=8,
                 preload=["socket"]) as box:
        yield box


def unix_server(directory: str) -> tuple[socket.socket, str]:
    path = os.path.join(directory, f"rl2-gap-{uuid.uuid4().hex[:8]}.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)  # any uid may connect, as many daemons' sockets allow
    server.listen()
    server.settimeout(0.5)
    return server, path


@needs_bwrap
def test_bwrap_hides_the_hosts_files_sockets_and_processes(bwrap_box, tmp_path):
    marker = f"rl2-secret-{uuid.uuid4().hex}"
    # Another run's files: in a temporary directory, and beside the checkout's own files (this test file).
    other_run = tempfile.mkdtemp(prefix="rl2-other-run-")
    os.chmod(other_run, 0o755)
    answers = os.path.join(other_run, "answers.jsonl")
    with open(answers, "w") as f:
        f.write(marker)
    os.chmod(answers, 0o644)
    readable = [answers, os.path.abspath(__file__), os.path.abspath(sandbox_module.__file__)]
    assert all(os.path.isfile(path) and os.stat(path).st_mode & 0o004 for path in readable)
    # Unix sockets of the host: one in a temporary directory, one in /run (where daemons keep theirs).
    places = [other_run] + (["/run"] if ROOT and os.access("/run", os.W_OK) else [])
    servers = [unix_server(place) for place in places]
    # A process of the host whose command line carries the secret.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    program = (
        "import os, socket\n"
        f"for path in {readable!r}:\n"
        "    try:\n        print('read', path, open(path).read()[:200])\n"
        "    except OSError as error:\n        print('blocked', path, type(error).__name__)\n"
        f"for path in {[path for _, path in servers]!r}:\n"
        "    try:\n        s = socket.socket(socket.AF_UNIX)\n        s.settimeout(1)\n        s.connect(path)\n"
        "        s.sendall(b'leak')\n        print('connected', path)\n"
        "    except OSError as error:\n        print('blocked', path, type(error).__name__)\n"
        "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
        "            print('cmdline', pid, open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' ')[-300:])\n"
        "        except OSError:\n            pass\n"
        "for d in ('/run', '/var', '/home', '/work', '/srv', '/mnt'):\n"
        "    if os.path.isdir(d):\n        print('listed', d, os.listdir(d))\n"
    )
    try:
        result = bwrap_box.run(program)
        for server, _ in servers:
            with pytest.raises(socket.timeout):
                server.accept()
    finally:
        sleeper.kill()
        sleeper.wait()
        for server, path in servers:
            server.close()
            os.unlink(path)
        os.unlink(answers)
        os.rmdir(other_run)
    assert result.reason == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert marker not in result.stdout  # neither the answers file nor the host process's command line
    assert not [line for line in lines if line.startswith(("read ", "connected "))], result.stdout
    assert len([line for line in lines if line.startswith("blocked ")]) == len(readable) + len(servers)
    assert [line for line in lines if line.startswith("cmdline ")]  # it sees its own namespace's processes only
    for line in lines:
        if line.startswith("listed"):
            assert line.endswith("[]"), line  # empty, read-only stand-ins


@needs_bwrap
def test_bwrap_plants_nothing_and_cannot_fill_shared_memory(bwrap_box):
    name = f"rl2-planted-{uuid.uuid4().hex[:8]}"
    plant = (
        "import os\n"
        f"for path in ('/run/lock/{name}', '/var/lock/{name}', '/var/tmp/{name}', '/dev/shm/{name}', '/tmp/{name}'):\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as error:\n        print('blocked', path, type(error).__name__)\n"
        "written = 0\n"
        "try:\n    for i in range(1000):\n        with open(f'/dev/shm/fill{i}', 'wb') as f:\n"
        "            for _ in range(4):\n                f.write(b'x' * 1024 * 1024)\n                written += 1\n"
        "except OSError as error:\n    print('full', error.errno)\n"
        "print('written_mb', written)\n"
    )
    result = bwrap_box.run(plant)
    assert result.reason == "ok", result.stderr
    lines = result.stdout.splitlines()
    # Only its private tmpfs take writes; /run/lock, /var/lock and /var/tmp are read-only stand-ins.
    assert sorted(line.split()[1] for line in lines if line.startswith("wrote")) == [f"/dev/shm/{name}", f"/tmp/{name}"]
    written = int(lines[-1].split()[1])
    # Files of 4 MB (under file_size_mb): only the size of the tmpfs, tmpfs_mb, stops it (ENOSPC).
    assert f"full {errno.ENOSPC}" in result.stdout and 16 <= written <= 32
    for path in (f"/run/lock/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", f"/tmp/{name}", "/dev/shm/fill0"):
        assert not os.path.exists(path), f"{path} reached the host"
    after = bwrap_box.run("import os\nprint(sorted(os.listdir('/dev/shm')), [n for n in os.listdir('/tmp') "
                          "if n.startswith(('rl2-planted', 'fill'))])")
    assert after.stdout == "[] []\n"  # nothing carries over to the next program


def test_auto_refuses_the_weaker_modes_unless_asked(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "bwrap_works", lambda: False)
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    weaker = "uid" if ROOT else "none"
    with pytest.raises(SandboxError) as refused:
        Sandbox(workers=1, uid_base=UID_BASE)
    message = str(refused.value)
    assert "bubblewrap" in message and "bwrap" in message and "allow_fallback=True" in message
    assert FALLBACK_ENV in message and f"isolation={weaker!r}" in message
    with pytest.raises(SandboxError):
        Sandbox(workers=1, uid_base=UID_BASE, allow_fallback=False)
    if ROOT:
        assert "unix sockets" in message and "/proc" in message and "/dev/shm" in message
    caplog.set_level(logging.WARNING, logger="rl2.tools.sandbox")
    with Sandbox(workers=1, uid_base=UID_BASE, allow_fallback=True) as box:
        assert box.isolation.startswith(weaker) and box.run("print(3)").stdout == "3\n"
    monkeypatch.setenv(FALLBACK_ENV, "1")
    with Sandbox(workers=1, uid_base=UID_BASE) as box:
        assert box.isolation.startswith(weaker)
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert f"isolation: {weaker}" in warnings
    if ROOT:
        assert "does not contain a hostile program" in warnings and "unix sockets" in warnings


@pytest.mark.skipif(not ROOT, reason="the uid mode needs root")
def test_uid_mode_cleans_what_its_uid_left_in_run_lock():
    if not os.path.isdir("/run/lock") or os.stat("/run/lock").st_mode & 0o002 == 0:
        pytest.skip("no world-writable /run/lock here")
    name = f"rl2-planted-{uuid.uuid4().hex[:8]}"
    with Sandbox(workers=1, isolation="uid", uid_base=UID_BASE, timeout=5.0) as box:
        result = box.run(f"open('/run/lock/{name}', 'w').write('x')\nprint('wrote')")
        assert result.stdout == "wrote\n"
        assert not os.path.exists(f"/run/lock/{name}")
