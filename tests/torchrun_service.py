"""A `torchrun` for the shell recipes the tests run, whose ranks `rank_launcher` forks from its preloaded server.

A recipe's tiny variant is a chain of `torchrun` launches (warm-up, stages, filter, evaluation); each real
launch spends ~15 CPU-seconds importing torch, transformers and rl2 in torchrun and in every rank before
seconds of work. `TorchrunService` puts an executable `torchrun` first on the PATH it gives the recipe: it
sends its command line, environment and working directory to this test process over a Unix socket, which
runs the ranks with `rank_launcher.launch` and sends back their output and exit status. A command line the
shim does not know (another torchrun option) runs the real torchrun.
"""

import json
import os
import socketserver
import stat
import sys
import tempfile
import threading

import rank_launcher

SHIM = '''#!{python}
"""torchrun, as the tests run it: the ranks are forked by the test process listening on {socket!r}."""
import json, os, socket, sys

args, nproc = sys.argv[1:], 1
while args and args[0].startswith("--") and args[0] != "--":
    option = args.pop(0)
    if option.startswith("--nproc_per_node=") or option.startswith("--nproc-per-node="):
        nproc = int(option.split("=", 1)[1])
    elif option in ("--nproc_per_node", "--nproc-per-node"):
        nproc = int(args.pop(0))
    elif option != "--standalone":
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *sys.argv[1:]])
request = {{"target": args, "nproc": nproc, "env": dict(os.environ), "cwd": os.getcwd()}}
with socket.socket(socket.AF_UNIX) as connection:
    connection.connect({socket!r})
    connection.sendall(json.dumps(request).encode() + b"\\n")
    reply = json.loads(connection.makefile().readline())
sys.stdout.write(reply["stdout"])
sys.stderr.write(reply["stderr"])
if reply["returncode"] < 0:  # a forked rank died by a signal: the real launcher decides (as forked_or_real)
    sys.stderr.write("torchrun shim: a forked rank died by a signal; running again under the real torchrun\\n")
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *sys.argv[1:]])
sys.exit(reply["returncode"])
'''


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request = json.loads(self.rfile.readline())
        result = rank_launcher.launch(request["target"], request["nproc"], request["env"], request["cwd"],
                                      timeout=self.server.timeout_s)
        reply = {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}
        self.wfile.write(json.dumps(reply).encode() + b"\n")


class TorchrunService:
    """`with TorchrunService() as bin_dir:` — put `bin_dir` first on a recipe's PATH."""

    def __init__(self, timeout: float = 600):
        self.timeout = timeout

    def __enter__(self) -> str:
        self.folder = tempfile.TemporaryDirectory(prefix="rl2-torchrun-")
        path = os.path.join(self.folder.name, "socket")
        self.server = socketserver.ThreadingUnixStreamServer(path, _Handler)
        self.server.timeout_s = self.timeout
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        shim = os.path.join(self.folder.name, "torchrun")
        with open(shim, "w") as f:
            f.write(SHIM.format(python=sys.executable, socket=path))
        os.chmod(shim, os.stat(shim).st_mode | stat.S_IXUSR)
        return self.folder.name

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
        self.folder.cleanup()
