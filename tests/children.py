"""The suite's train.py children, started from a process that has already imported the heavy libraries.

A `python train.py ...` child spends 5-10 s of CPU importing JAX, TensorFlow (clu's TensorBoard writer), orbax and
grain before its first line of work, and the suite starts dozens of them. `Popen` here is `subprocess.Popen` for
`[sys.executable, SCRIPT, ...]` commands, but the child is forked from a *zygote*: one process per test worker that
imported those libraries once (without starting a JAX backend) and forks a child per command. The child then runs
as `python SCRIPT ...` does: the command's environment, working directory, standard streams (pipes, files, the
inherited ones), `sys.argv` and `sys.path[0]`, the signal handlers a started interpreter has (what the test's
process ignores stays ignored, as across an exec; SIGPIPE ignored, as Python starts: a write to a closed pipe or
socket raises, it does not kill), `__main__` run by runpy, and the
interpreter's own exit (atexit handlers, non-daemon threads joined, the exit status of SystemExit or 1 after an
uncaught exception's traceback). Its pid is real (signals reach it); its exit status comes back from the zygote.

What the zygote imported is not imported again, so two things differ from a fresh interpreter: output those imports
print (none, with TF_CPP_MIN_LOG_LEVEL=2) does not appear, and a library that reads the environment when imported
keeps the zygote's reading. That is why the zygote imports only libraries that read no test-varied variable at
import (Hugging Face's, which read HF_HOME and HF_HUB_OFFLINE then, and tfds, which reads TFDS_DATA_DIR, are left
to the child), and why JAX's configuration, which JAX reads from JAX_* variables at import, is read again from the
child's environment. `python -c CODE ...` forks the same way; commands of any other form (another program, `-m`,
interpreter options) go to `subprocess.Popen`. Tests of what a process does before or while importing, or at its own
exit, keep real processes (tests/test_bad_input_cli.py among them).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Imported once in the zygote: what every entry point imports, minus those that read test-varied variables at import.
PRELOAD = ('jax', 'jax.numpy', 'flax.nnx', 'optax', 'orbax.checkpoint', 'grain', 'tensorflow', 'clu.metric_writers')
_HEADER = struct.Struct('!I')


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
  data = json.dumps(message).encode()
  socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
  """One message and the descriptors sent with it; (None, []) when the other end has closed."""
  head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 8)
  if not head:
    return None, []
  while len(head) < _HEADER.size:
    head += sock.recv(_HEADER.size - len(head))
  (size,) = _HEADER.unpack(head)
  data = b''
  while len(data) < size:
    part = sock.recv(size - len(data))
    if not part:
      return None, []
    data += part
  return json.loads(data), fds


# --- The zygote -----------------------------------------------------------------------------------------------


def _reread_jax_config(before: dict[str, str]) -> None:
  """JAX reads JAX_* variables when it is imported; apply the ones the child's environment sets differently."""
  import jax  # noqa: PLC0415

  holders = jax.config._value_holders  # noqa: SLF001  (the names JAX reads as NAME.upper())
  for name, holder in holders.items():
    var = name.upper()
    value = os.environ.get(var)
    if value == before.get(var) or value is None:
      continue
    current = holder.value
    if isinstance(current, bool):
      parsed = value.lower() in ('y', 'yes', 't', 'true', 'on', '1')
    elif isinstance(current, int):
      parsed = int(value)
    elif isinstance(current, float):
      parsed = float(value)
    else:
      parsed = value
    jax.config.update(name, parsed)


def _std_streams(unbuffered: bool) -> None:
  """sys.stdout and sys.stderr over descriptors 1 and 2 as a fresh interpreter makes them: written through under
  PYTHONUNBUFFERED; else stdout line-buffered on a terminal and block-buffered otherwise, stderr line-buffered."""
  for fd, name in ((1, 'stdout'), (2, 'stderr')):
    raw = io.FileIO(fd, 'w', closefd=False)
    stream = io.TextIOWrapper(
      raw if unbuffered else io.BufferedWriter(raw),
      encoding='utf-8',
      errors='backslashreplace' if name == 'stderr' else 'strict',
      line_buffering=not unbuffered and (name == 'stderr' or os.isatty(fd)),
      write_through=unbuffered,
    )
    setattr(sys, name, stream)
    setattr(sys, f'__{name}__', stream)
  sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, 'r', closefd=False), encoding='utf-8')


INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP)  # a child's, from the test's process


def _become(request: dict, fds: list[int], sock: socket.socket, before: dict[str, str]) -> tuple[str, bool]:
  """In the forked child: take on the command's streams, environment, directory and argv; (the script's path or,
  for `-c`, its source text; whether it is source text)."""
  sock.close()
  for target, fd in zip((0, 1, 2), fds, strict=True):
    os.dup2(fd, target)
  for fd in set(fds):
    if fd > 2:
      os.close(fd)
  # As a started interpreter's: what its parent ignored stays ignored, the rest at its default, SIGINT raising
  # KeyboardInterrupt, and SIGPIPE ignored as Python starts (at its default, a 2-process run whose peer had closed
  # the coordination socket died of SIGPIPE, exit -13, where `python train.py` gets EPIPE).
  for sig in INHERITED:
    ignored = int(sig) in request['ignored']
    signal.signal(
      sig, signal.SIG_IGN if ignored else signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    )
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)
  atexit._clear()  # noqa: SLF001  (the zygote's handlers are not the command's)
  os.environ.clear()
  os.environ.update(request['env'])
  os.chdir(request['cwd'])
  argv = request['argv']
  _std_streams(bool(os.environ.get('PYTHONUNBUFFERED')))
  _reread_jax_config(before)
  if argv[0] == '-c':  # python -c CODE ARGS: sys.argv is ['-c', ARGS], the current directory first on the path
    sys.path[0] = ''
    sys.argv = ['-c', *argv[2:]]
    return argv[1], True
  script = os.path.abspath(argv[0])
  sys.path[0] = os.path.dirname(script)
  sys.argv = argv
  return script, False


def _serve(sock: socket.socket) -> tuple[str, bool] | None:
  """The zygote's loop: fork a child per request, report each child's pid and exit status. Returns in a forked child
  (what to run), or None when the test worker has gone."""
  before = {k: v for k, v in os.environ.items() if k.startswith('JAX_')}
  running: set[int] = set()
  while True:
    readable, _, _ = select.select([sock], [], [], 0.02)
    if readable:
      request, fds = _recv(sock)
      if request is None:
        return None
      sys.stdout.flush(), sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        return _become(request, fds, sock, before)
      for fd in set(fds):
        os.close(fd)
      running.add(pid)
      _send(sock, {'id': request['id'], 'pid': pid})
    for pid in list(running):
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        running.discard(pid)
        _send(sock, {'pid': pid, 'status': status})


def _zygote(fd: int) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle; the zygote ends with it
  for module in PRELOAD:
    __import__(module)
  sock = socket.socket(fileno=fd)
  _send(sock, {'ready': True})
  job = _serve(sock)
  if job is None:
    os._exit(0)
  os._exit(_run(*job))


def _run(script: str, code: bool = False) -> int:
  """Runs the script (with `code`: the source text `script`) as __main__ and ends as the interpreter would (the
  traceback of an uncaught exception, the status of SystemExit, non-daemon threads joined, atexit handlers run,
  streams flushed); returns the exit status. The child then leaves by os._exit: the interpreter's own finalisation
  of what the zygote imported (whose threads are not in the fork) crashes."""
  import runpy  # noqa: PLC0415
  import traceback  # noqa: PLC0415

  try:
    if code:
      exec(compile(script, '<string>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})
    else:
      runpy.run_path(script, run_name='__main__')
    status = 0
  except SystemExit as e:
    status = _exit_status(e.code)
  except BaseException:  # noqa: BLE001  (reported as the interpreter reports it)
    traceback.print_exc()
    status = 1
  try:
    threading._shutdown()  # noqa: SLF001  (what the interpreter does first at exit)
    atexit._run_exitfuncs()  # noqa: SLF001
  except BaseException:  # noqa: BLE001
    traceback.print_exc()
    status = status or 1
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  return status


def _exit_status(code) -> int:
  if code is None:
    return 0
  if isinstance(code, int):
    return code & 0xFF
  print(code, file=sys.stderr)
  return 1


# --- The test worker's side -------------------------------------------------------------------------------------


class _Zygote:
  """The worker's zygote: started on first use, one socket; a thread files each child's exit status by pid."""

  def __init__(self):
    parent, child = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
    env.update(JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
    self.process = subprocess.Popen(
      [sys.executable, '-c', f'from tests.children import _zygote; _zygote({child.fileno()})'],
      cwd=ROOT,
      env=env,
      pass_fds=[child.fileno()],
      stdin=subprocess.DEVNULL,
    )
    child.close()
    self.sock = parent
    self.lock = threading.Lock()
    self.cond = threading.Condition()
    self.started: dict[int, int] = {}  # request id -> pid
    self.exited: dict[int, int] = {}  # pid -> wait status
    self.next_id = 0
    ready, _ = _recv(self.sock)
    if not ready:
      raise RuntimeError(f'the test zygote did not start (exit {self.process.wait()})')
    threading.Thread(target=self._listen, daemon=True).start()

  def _listen(self) -> None:
    while True:
      message, _ = _recv(self.sock)
      with self.cond:
        if message is None:
          self.sock = None
          self.cond.notify_all()
          return
        if 'id' in message:
          self.started[message['id']] = message['pid']
        else:
          self.exited[message['pid']] = message['status']
        self.cond.notify_all()

  def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> int:
    with self.lock:
      self.next_id += 1
      rid = self.next_id
      # the signals a started command would inherit as ignored (an exec keeps SIG_IGN; nohup ignores SIGHUP)
      ignored = [int(sig) for sig in INHERITED if signal.getsignal(sig) == signal.SIG_IGN]
      _send(self.sock, {'id': rid, 'argv': argv, 'env': env, 'cwd': cwd, 'ignored': ignored}, fds)
    with self.cond:
      self.cond.wait_for(lambda: rid in self.started or self.sock is None)
      if rid not in self.started:
        raise RuntimeError('the test zygote has gone')
      return self.started.pop(rid)

  def wait(self, pid: int, timeout: float | None) -> int | None:
    """The child's wait status, or None if it has not exited within `timeout` seconds (0: do not wait)."""
    with self.cond:
      self.cond.wait_for(lambda: pid in self.exited or self.sock is None, timeout)
      if pid in self.exited:
        return self.exited[pid]
      if self.sock is None:
        raise RuntimeError('the test zygote has gone')
      return None


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote_here() -> _Zygote:
  global _ZYGOTE
  with _ZYGOTE_LOCK:
    if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
      _ZYGOTE = _Zygote()
    return _ZYGOTE


def forkable(args) -> bool:
  """`[sys.executable, SCRIPT.py, ...]` or `[sys.executable, '-c', CODE, ...]`."""
  if isinstance(args, (str, bytes)) or len(args) < 2 or str(args[0]) != sys.executable:
    return False
  first = str(args[1])
  return (first == '-c' and len(args) > 2) or (first.endswith('.py') and not first.startswith('-'))


class Popen(subprocess.Popen):
  """subprocess.Popen; a `[sys.executable, SCRIPT.py, ...]` command runs in a child forked from the zygote."""

  def __init__(self, args, **kwargs):
    self._forked = forkable(args) and not kwargs.get('shell') and not kwargs.get('preexec_fn')
    super().__init__(args, **kwargs)

  def _execute_child(self, args, *rest):
    if not self._forked:
      return super()._execute_child(args, *rest)
    # subprocess.Popen's own call: (executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
    # creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, ...)
    cwd, env = rest[4], rest[5]
    p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = rest[9:15]
    argv = [str(a) for a in args[1:]]
    cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    if argv[0] != '-c':
      argv[0] = os.path.join(cwd, argv[0])
    env = dict(os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
    fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
    try:
      self._zygote = _zygote_here()
      self.pid = self._zygote.spawn(argv, env, cwd, fds)
      self._child_created = True
    finally:
      self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

  def _try_wait(self, wait_flags):
    if not self._forked:
      return super()._try_wait(wait_flags)
    status = self._zygote.wait(self.pid, 0 if wait_flags & os.WNOHANG else None)
    return (0, 0) if status is None else (self.pid, status)

  def _internal_poll(self, _deadstate=None, **kwargs):
    if not self._forked:
      return super()._internal_poll(_deadstate, **kwargs)
    if self.returncode is None and self._waitpid_lock.acquire(False):
      try:
        if self.returncode is None:
          pid, status = self._try_wait(os.WNOHANG)
          if pid == self.pid:
            self._handle_exitstatus(status)
      finally:
        self._waitpid_lock.release()
    return self.returncode


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):  # noqa: A002
  """subprocess.run over this module's Popen."""
  if capture_output:
    kwargs['stdout'] = kwargs['stderr'] = subprocess.PIPE
  if input is not None:
    kwargs['stdin'] = subprocess.PIPE
  with Popen(args, **kwargs) as process:
    try:
      stdout, stderr = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      raise
    except BaseException:
      process.kill()
      raise
    code = process.poll()
    if check and code:
      raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
  return subprocess.CompletedProcess(process.args, code, stdout, stderr)
