"""The errors shardzoo raises for bad input and for what stops a run (divergence, disk trouble). Each is
raised before anything compiles where possible, and
its message is one line that names the culprit (config field, parameter path, logical axis, mesh axes,
sizes, file). train.py and the other entry points print it as `shardzoo: <kind> error: <message>`, with no
traceback (`one_line`)."""

import contextlib
import errno
import os
import re
import sys
from typing import NamedTuple


class ConfigError(ValueError):
  """A bad config value, found before anything compiles. The message names the culprit."""


class ShardingError(ConfigError):
  """A sharding problem (rules, mesh, divisibility) found before compilation."""


class CheckpointError(ConfigError):
  """A checkpoint that is missing, corrupt, or does not fit the model being trained."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint whose metadata or data cannot be read (truncated, garbage, half-written)."""


class HFImportError(ConfigError):
  """A Hugging Face directory that cannot be imported as the configured model."""


class HFExportError(ConfigError):
  """A model, table or dtype that cannot be written in its family's Hugging Face layout."""


class NonFiniteError(RuntimeError):
  """Training met a non-finite loss or gradient (config.on_nonfinite): names the step and the parameter.
  Not bad input: the parameters stayed finite, and no checkpoint was written after the bad step."""


class DeviceMemoryError(ConfigError):
  """A compiled step that needs more memory per device than the device has: names both figures and what to
  change (batch size, remat, sharding). Found after compiling, before any state is allocated."""


# What an out-of-memory from XLA (RESOURCE_EXHAUSTED: at compile time on TPUs, when allocating on GPUs) is
# followed by in one_line's message.
OUT_OF_MEMORY_ADVICE = (
  'lower the batch size (config.batch_size), recompute more in the backward pass '
  '(config.model.remat), or shard the state and activations over more devices (config.mesh, '
  'config.logical_axis_rules)'
)


def out_of_device_memory(e: BaseException) -> str | None:
  """XLA's first line when `e` is its out-of-memory error (jax.errors.JaxRuntimeError, RESOURCE_EXHAUSTED), else
  None. Read by name: this module does not import JAX."""
  text = str(e).strip()
  if type(e).__name__ != 'JaxRuntimeError' or not text.startswith('RESOURCE_EXHAUSTED'):
    return None
  return text.splitlines()[0].rstrip('.')


class StorageError(RuntimeError):
  """The run cannot write where it must: a workdir that is not writable (found before anything compiles), a disk
  that fills up mid-save, a save that blocks. Names the directory, the step and the OS error. Not bad input: the
  checkpoints written before it are intact, and a rerun resumes from the newest. `blocked`: threads of the save
  are blocked and may never return (one_line then ends the process without waiting for them)."""

  blocked = False


def describe_os_error(code: int | None, strerror: str | None, filename: str | None) -> str:
  name = f'{errno.errorcode[code]}, ' if code in errno.errorcode else ''
  return f'{strerror} [{name}errno {code}]' + (f' ({filename})' if filename else '')


class OsError(NamedTuple):
  """An OS error as the one-line messages name it."""

  code: int
  strerror: str
  filename: str | None
  filename2: str | None = None  # a rename's destination


def os_error_of(e: BaseException) -> OsError | None:
  """The OS error behind `e` (it, or what caused it): an OSError, or TensorStore's ValueError that carries
  os_error_code (how a failed array write reaches orbax); None otherwise."""
  while e is not None:
    if isinstance(e, OSError) and e.errno:
      return OsError(e.errno, e.strerror or os.strerror(e.errno), e.filename, getattr(e, 'filename2', None))
    m = re.search(r"os_error_code='?(\d+)", str(e)) if isinstance(e, ValueError) else None
    if m:
      paths = re.findall(r'"(/[^"]+)"', str(e))
      return OsError(int(m.group(1)), os.strerror(int(m.group(1))), paths[-1] if paths else None)
    e = e.__cause__ or e.__context__
  return None


def usage(message: str) -> SystemExit:
  """For entry points: a command line that lacks a required flag or has a stray argument ends with this one line,
  `shardzoo: usage error: <message>` (absl's app.UsageError would print every flag first)."""
  return SystemExit(f'shardzoo: usage error: {message} (--help for all flags)')


@contextlib.contextmanager
def one_line():
  """For entry points (train.py, search.py, benchmarks/): these errors end the program with their one line,
  `shardzoo: <kind> error: <message>` (`training stopped: ...` for a NonFiniteError), and no traceback."""
  try:
    yield
  except ShardingError as e:  # bad rules, mesh or sizes
    raise SystemExit(f'shardzoo: sharding error: {e}') from None
  except DeviceMemoryError as e:  # the compiled step needs more than the device has
    raise SystemExit(f'shardzoo: memory error: {e}') from None
  except CheckpointError as e:  # missing, corrupt or not this model's: not a config problem
    raise SystemExit(f'shardzoo: checkpoint error: {e}') from None
  except ConfigError as e:
    raise SystemExit(f'shardzoo: config error: {e}') from None
  except StorageError as e:  # the directory and the OS error are named; earlier checkpoints are intact
    if e.blocked:  # the interpreter would wait for the blocked threads before exiting: the line, then exit now
      print(f'shardzoo: storage error: {e}', file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(1)
    raise SystemExit(f'shardzoo: storage error: {e}') from None
  except NonFiniteError as e:  # the parameters stayed finite; the last good checkpoint is named
    raise SystemExit(f'shardzoo: training stopped: {e}') from None
  except Exception as e:  # XLA out of device memory: its own line, then what to change; anything else as it is
    if (line := out_of_device_memory(e)) is None:
      raise
    raise SystemExit(f'shardzoo: memory error: out of device memory ({line}): {OUT_OF_MEMORY_ADVICE}') from None
