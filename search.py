r"""Searches meshes x logical-axis rules x remat policies (x micro-batches where a plan does not fit) for a config,
ranks them by predicted step time.

  python search.py --config configs/llama.py --devices 8 --device_kind h100 --out /tmp/plan.py
  python search.py --config configs/llama.py:llama3_8b --devices 64 --hosts 8 --device_kind h100
  python search.py --config configs/gpt2.py:tiny --devices 8 --device_kind cpu --measure 3

`main` takes the steps of planning/stages.py in order: check the input (before JAX starts) -> devices (the real
ones, else --devices simulated CPU devices) -> the memory target (for a GPU or TPU chip whose compiler is installed,
compile-only devices of it: --compile_target) -> stage 1: candidates (the config file's presets and variants of
them, every mesh factorisation, axis orders over hosts), pruned by validation, the survivors compiled abstractly and
their step time predicted (planning/search.py, planning/cost.py) -> stage 2: the presets' variants and the other
remat policies on the best plans -> --measure: real steps of the top K -> the table and the choice -> --out: the
winner as a config file.
"""

from __future__ import annotations

import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

import errors
import models
from configs import cli
from models import attention
from planning import stages
from training import flops

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/llama.py[:preset,size].', lock_config=True)
flags.DEFINE_integer('devices', None, 'Devices to plan for (compiled on as many simulated CPU devices).')
flags.DEFINE_string('device_kind', None, f'The target chip: one of {sorted(flops.CHIPS)}.')
flags.DEFINE_integer('hosts', 1, 'Hosts (or slices) the devices are spread over: collectives across them use DCN.')
flags.DEFINE_integer('top', 10, 'Rows of the ranked table.')
flags.DEFINE_integer('measure', 0, 'Run the top K plans for real (needs --devices devices) and print measured times.')
flags.DEFINE_integer('measure_steps', 3, 'Timed steps per measured plan (after one warm-up step).')
flags.DEFINE_string('out', None, 'Write the winning plan here as a config file train.py --config accepts.')
flags.DEFINE_bool('overwrite', False, 'Let --out replace an existing file (never the --config file itself).')
flags.DEFINE_string(
  'remat',
  'staged',
  "'staged': the config's remat first, every policy on the best --stage2 plans; "
  "'config': the config's only; or a comma-separated list of policies.",
)
flags.DEFINE_integer(
  'stage2',
  3,
  "How many of stage 1's best plans (presets only) try their presets' variants "
  'and, with --remat=staged, every remat policy.',
)
flags.DEFINE_integer('workers', 2, 'Compilations run in parallel.')
flags.DEFINE_list(
  'micro_batches',
  ['2', '4', '8'],
  'A plan over the device memory is tried again with config.grad_accum_steps = each of these (smallest first) '
  'until it fits; empty: never.',
)
flags.DEFINE_string(
  'compile_target',
  'auto',
  "Planned on CPU for a GPU or TPU chip, each plan's memory: 'auto' "
  "compiles for the chip itself (its GPU target in planning/gpu_targets where JAX's CUDA plugin is "
  'installed; a TPU chip where libtpu is), exactly; '
  "'none' models it from what the backward keeps; or a target: a TPU chip (tpu_v5e, ...), a GPU "
  "target's name or .txtpb file.",
)
flags.DEFINE_alias('gpu_target', 'compile_target')  # its name before TPUs compiled too


def main(argv) -> None:
  del argv  # cli.parse_flags refused stray arguments
  config = FLAGS.config
  if config is None or FLAGS.devices is None or FLAGS.device_kind is None:
    raise errors.usage(
      '--config, --devices and --device_kind are required, e.g. --config configs/llama.py '
      '--devices 8 --device_kind h100'
    )
  logging.set_verbosity(logging.WARNING)
  t_start = time.perf_counter()
  with errors.one_line():  # bad input: one line, no traceback
    req = stages.check_input(  # before JAX starts
      config,
      config_flags.get_config_filename(FLAGS['config']),
      FLAGS.device_kind,
      FLAGS.devices,
      FLAGS.hosts,
      {name: FLAGS[name].value for name in stages.LEAST},
      FLAGS.remat,
      FLAGS.micro_batches,
      FLAGS.out,
      FLAGS.overwrite,
    )
    devices = stages.start_devices(req)
    memory = stages.memory_target(req, devices, FLAGS.compile_target)
    create = lambda m, r: models.create(m, r, config.lora)  # planning/ imports no model
    search = stages.make_search(req, devices, memory, FLAGS.workers, create, attention.gpu_stand_in)
    result = stages.stage1(search, req)
    stages.stage2(search, req, result, FLAGS.stage2)
    fits = stages.fitting(result, req)
    stages.measure(search, req, fits, FLAGS.measure, FLAGS.measure_steps)
    stages.table(result, req, fits, FLAGS.top)
    choice = stages.choose(fits, memory, t_start)
    if FLAGS.out:
      stages.write_plan(req, choice, FLAGS.out, FLAGS.overwrite)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  app.run(main, flags_parser=cli.parse_flags)
