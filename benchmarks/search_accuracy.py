r"""How well the plan search's cost model ranks plans: predicted vs measured step time of every candidate.

  python benchmarks/search_accuracy.py --config configs/llama.py:tiny --out /tmp/acc_llama.json
  python benchmarks/search_accuracy.py --fit /tmp/acc_llama.json --report /tmp/acc_gpt2.json /tmp/acc_moe.json

Run mode: the search (planning/search.py) over every mesh x rule set of the config on 8 simulated CPU devices
(the config's remat), then every compiled plan's real train step, `--rounds` rounds of `--steps` steps,
round-robin over the plans so that load from other processes on the machine hits all of them alike; the
median step time is the measurement. Writes each plan's compiled figures and times as JSON.
Fit mode: fits the 'cpu' chip's calibration (compute_eff, link_eff, latency_us; least squares on the
--fit files only) and prints, for every file, Spearman's rank correlation of predicted vs measured and how
much slower the predicted winner ran than the fastest measured plan, with the fitted and the table's constants.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import partitioning  # noqa: E402
from planning import candidates, cost  # noqa: E402
from training import flops  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/llama.py:tiny.', lock_config=True)
flags.DEFINE_integer('devices', 8, 'Simulated CPU devices.')
flags.DEFINE_integer('rounds', 5, 'Measurement rounds (round-robin over the plans).')
flags.DEFINE_integer('steps', 3, 'Steps per plan per round.')
flags.DEFINE_string('out', None, 'Run mode: write the results here (JSON).')
flags.DEFINE_multi_string('fit', [], 'Fit mode: result files to calibrate on.')
flags.DEFINE_multi_string('report', [], 'Fit mode: further result files to report on (not fitted).')


def _profile_json(p: cost.Profile) -> dict:
  return dict(flops=p.flops, bytes_accessed=p.bytes_accessed, memory=p.memory, argument_bytes=p.argument_bytes,
              temp_bytes=p.temp_bytes, collectives=[[dataclasses.asdict(k), list(v)] for k, v in p.collectives.items()])


def _profile(d: dict) -> cost.Profile:
  return cost.Profile(d['flops'], d['bytes_accessed'], d['memory'], d['argument_bytes'], d['temp_bytes'],
                      {cost.CollectiveKey(k['op'], tuple(k['axes']), k['group'], k['hosts']): tuple(v)
                       for k, v in d['collectives']})


def run(config) -> None:
  partitioning.simulate_cpu_devices(FLAGS.devices)
  import models
  from planning import search as search_lib
  path, _, arg = config_flags.get_config_filename(FLAGS['config']).partition(':')
  rules = candidates.rule_variants(candidates.presets_of(path, arg or None, config))
  axes = candidates.mesh_axes_of(rules, list(config.mesh))
  chip = flops.chip('cpu')
  s = search_lib.Search(config, lambda m, r: models.create(m, r), chip, FLAGS.devices, log=print)
  result = s.run(candidates.generate(FLAGS.devices, axes, rules, [config.model.get('remat')]))
  print(f'search: {result.compiled} plans compiled in {result.wall_s:.0f} s; pruned {dict(result.pruned)}', flush=True)
  plans = [p for p in result.ranked if p.prediction.fits]
  s.measure(plans, steps=FLAGS.steps, rounds=FLAGS.rounds)
  rows = [dict(plan=p.candidate.label(), predicted_s=p.prediction.step_s, measured_s=p.measured_s,
               times=p.measured_times, profile=_profile_json(p.profile)) for p in plans]
  with open(FLAGS.out, 'w') as f:
    json.dump(dict(config=f'{path}:{arg}', devices=FLAGS.devices, search_s=result.wall_s, plans=rows), f, indent=1)
  report([FLAGS.out], chip, 'table constants')


def _features(p: cost.Profile, n: int, base: flops.Chip) -> list[float]:
  """Step time = a x FLOPs-seconds + b x collective runs + c x byte-seconds + d, linear in the calibration."""
  runs = sum(r for r, _ in p.collectives.values())
  moved = sum(cost.MOVED[k.op](k.group) * b for k, (_, b) in p.collectives.items())
  return [p.flops * n / (base.peak_tflops * 1e12), runs * 1e-6, moved * n / (base.ici_gbps * 1e9), 1.0]


def fit(files: list[str], base: flops.Chip) -> flops.Chip:
  import numpy as np
  from scipy.optimize import nnls
  X, y = [], []
  for path in files:
    data = json.load(open(path))
    for r in data['plans']:
      X.append(_features(_profile(r['profile']), data['devices'], base))
      y.append(r['measured_s'])
  X, y = np.array(X), np.array(y)
  # Per-file intercepts would be fairer; one intercept keeps the fit small. Weights: relative error.
  w = 1 / y
  coef, _ = nnls(X * w[:, None], y * w)
  a, b, c, _ = coef
  return dataclasses.replace(base, compute_eff=1 / a if a else base.compute_eff, latency_us=b,
                             dcn_latency_us=b, link_eff=1 / c if c else base.link_eff)


def report(files: list[str], chip: flops.Chip, what: str) -> None:
  from planning.search import spearman
  print(f'\n{what}: compute_eff {chip.compute_eff:.3g}, latency {chip.latency_us:.3g} us, link_eff {chip.link_eff:.3g}')
  for path in files:
    data = json.load(open(path))
    pred = [cost.predict(_profile(r['profile']), chip, data['devices']).step_s for r in data['plans']]
    meas = [r['measured_s'] for r in data['plans']]
    win = min(range(len(pred)), key=pred.__getitem__)
    gap = meas[win] / min(meas) - 1
    print(f'  {data["config"]}: {len(meas)} plans, Spearman {spearman(pred, meas):.3f}, chosen {data["plans"][win]["plan"]} '
          f'{1e3 * meas[win]:.1f} ms vs best measured {1e3 * min(meas):.1f} ms ({100 * gap:+.1f}%); search '
          f'{data["search_s"]:.0f} s')


def main(argv) -> None:
  if FLAGS.fit:
    base = flops.chip('cpu')
    report(FLAGS.fit + FLAGS.report, base, 'table constants (training/flops.py)')
    report(FLAGS.fit + FLAGS.report, fit(FLAGS.fit, base), f'fitted on {FLAGS.fit}')
  else:
    run(FLAGS.config)


if __name__ == '__main__':
  app.run(main)
