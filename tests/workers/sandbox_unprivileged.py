"""Run by test_sandbox as an unprivileged user: the bubblewrap sandbox with a user namespace and the
limits-only fallback. Prints a JSON report."""

import json
import logging
import os
import socket

from rl2.tools.sandbox import Sandbox

logging.basicConfig(level=logging.INFO)
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
connect = (
    f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1)\n"
    "    print('connected')\nexcept OSError as error:\n    print('blocked', error)"
)
target = os.path.join(os.getcwd(), "owned")
write = f"try:\n    open({target!r}, 'w').write('x')\n    print('wrote')\nexcept OSError as error:\n    print('blocked', error)"
report = {}
with Sandbox(workers=1, isolation="bwrap", timeout=2.0) as box:
    report["bwrap"] = {
        "isolation": box.isolation,
        "network": box.run(connect).stdout,
        "write": box.run(write).stdout if not os.path.exists(target) else "existed",
        "kill_worker": box.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)").reason,
        "after_killing_worker": box.run("print(1)").reason,
    }
    assert not os.path.exists(target)
with Sandbox(workers=1, isolation="none", timeout=1.0) as box:
    report["none"] = {"isolation": box.isolation, "timeout": box.run("while True:\n    pass").reason}
print(json.dumps(report))
