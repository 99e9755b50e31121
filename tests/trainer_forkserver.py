"""tools/trainer.py runs for the tests, each a process of its own, forked from a server
that imported TensorFlow and the library once.

A trainer started as `python tools/trainer.py` spends about 4 s of its 5 importing
TensorFlow (2-core machine, TinyConvNet for 40 steps); the suite runs it about a
hundred times. Here each pytest worker starts one server (`python
tests/trainer_forkserver.py`), which imports what the trainer imports, then for each
run forks a child that runs the trainer as `python tools/trainer.py ARGS` would: its
own pid, environment, working directory, file-size limit, standard streams and exit
status (through `sys.exit` and the interpreter's own exit: atexit handlers and
finalizers run). The server runs no TensorFlow op, so each child starts TensorFlow's
runtime (devices, thread pools) itself, as a fresh process does.

What a forked run cannot show, a test that needs it runs `tools/trainer.py` in a fresh
interpreter (`conftest.run_trainer(..., fresh_process=True)`): the trainer's own
quiet import of TensorFlow, and environment variables TensorFlow reads when imported.

Protocol (one JSON object per line): the client writes a request {argv, env, cwd,
stdout, stderr (file paths), file_size_limit}; the server answers {"pid": P} once the
child runs and {"exit": CODE} once it ended (CODE as subprocess reports it: −N for
signal N).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "tools" / "trainer.py"
# What the trainer imports (itself, lazily) before its first op.
PRELOAD = ("tensorflow", "absl.app", "lingvo_gpipe.trainer", "lingvo_gpipe.exporter",
           "lingvo_gpipe.decoder", "lingvo_gpipe.planning", "lingvo_gpipe_params")


# -- the server ----------------------------------------------------------------------------


def _serve() -> dict | None:
  """Answers requests until stdin closes (→ None); in a forked child, returns its
  request."""
  import importlib

  for name in PRELOAD:
    importlib.import_module(name)
  requests, replies = sys.stdin, sys.stdout
  for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
      return request
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
  return None


def _become_trainer(request: dict) -> None:
  """In the forked child: the process `python tools/trainer.py ARGV` would be, then
  the trainer itself (its sys.exit ends this interpreter)."""
  import resource
  import runpy
  import signal

  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
  sys.stdin = open(0, closefd=False)  # noqa: SIM115  (the standard streams, re-opened)
  sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
  sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
  os.environ.clear()
  os.environ.update(request["env"])
  os.chdir(request["cwd"])
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if request["file_size_limit"]:
    limit = request["file_size_limit"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  sys.argv = [str(TRAINER), *request["argv"]]
  sys.path[0] = str(TRAINER.parent)
  runpy.run_path(str(TRAINER), run_name="__main__")


# -- the client ------------------------------------------------------------------------------


class TrainerServer:
  """A pytest worker's server: `run` is `subprocess.run([python, tools/trainer.py,
  *args], capture_output=True, text=True, ...)` with a forked child."""

  def __init__(self):
    self._process: subprocess.Popen | None = None
    # What the server wrote past its last whole line: its replies are read with
    # os.read, not a buffered readline, which could hold the next line where select()
    # cannot see it.
    self._unread = b""

  def _server(self) -> subprocess.Popen:
    if self._process is None or self._process.poll() is not None:
      self._process = subprocess.Popen(
          [sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, text=True, cwd=REPO,
          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
      self._unread = b""
    return self._process

  def _reply(self, server: subprocess.Popen, deadline: float | None) -> dict | None:
    """The server's next line (None: none before `deadline`)."""
    fd = server.stdout.fileno()
    while b"\n" not in self._unread:
      timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
      if not select.select([fd], [], [], timeout)[0]:
        return None
      chunk = os.read(fd, 4096)
      if not chunk:
        raise RuntimeError(f"the trainer fork server (pid {server.pid}) exited "
                           f"with {server.wait()}")
      self._unread += chunk
    line, self._unread = self._unread.split(b"\n", 1)
    return json.loads(line)

  def run(self, args: list[str], env: dict[str, str], timeout: float,
          file_size_limit: int | None) -> subprocess.CompletedProcess:
    server = self._server()
    with tempfile.TemporaryDirectory(prefix="trainer_run_") as folder:
      out, err = Path(folder, "stdout"), Path(folder, "stderr")
      out.touch()
      err.touch()
      server.stdin.write(json.dumps({
          "argv": list(args), "env": env, "cwd": str(REPO), "stdout": str(out),
          "stderr": str(err), "file_size_limit": file_size_limit}) + "\n")
      server.stdin.flush()
      pid = self._reply(server, None)["pid"]
      ended = self._reply(server, time.monotonic() + timeout)
      if ended is None:
        with contextlib.suppress(ProcessLookupError):  # (it may end meanwhile)
          os.kill(pid, 9)
        self._reply(server, None)
        raise subprocess.TimeoutExpired([str(TRAINER), *args], timeout,
                                        out.read_text(), err.read_text())
      return subprocess.CompletedProcess([str(TRAINER), *args], ended["exit"],
                                         out.read_text(errors="replace"),
                                         err.read_text(errors="replace"))

  def pid(self) -> int | None:
    """The server's pid while it runs (None before the first run)."""
    return None if self._process is None or self._process.poll() is not None \
        else self._process.pid

  def close(self) -> None:
    if self._process is not None and self._process.poll() is None:
      self._process.stdin.close()
      self._process.wait(timeout=30)


if __name__ == "__main__":
  child_request = _serve()
  if child_request is not None:
    _become_trainer(child_request)
