"""The cost model: a compiled step's per-device figures -> a predicted step time on a chip.

    compute    = max(FLOPs / (peak x compute_eff), bytes accessed / HBM bandwidth)   (FLOPs alone for a GPU/TPU
                 target compiled on CPU: see `predict`)
    collective = sum over collectives of runs x (latency + bytes moved / (link bandwidth x link_eff))
    step       = overhead + compute + collective (no overlap assumed: a plan that hides its collectives
                                                  behind compute does better than predicted; overhead: the
                                                  chip's fixed cost per step, 0 except where fitted)
Bytes moved per device, ring algorithms over a group of n (R = the result bytes per device):
    all-gather R (n-1)/n,  reduce-scatter R (n-1),  all-reduce 2 R (n-1)/n,  all-to-all R (n-1)/n,
    collective-permute R.
A collective whose group spans more than one host runs at the DCN bandwidth and latency, else at ICI/NVLink's.
On a `shared` chip (simulated CPU devices on one host's cores) every device's work queues for the same cores:
compute and collectives are summed over the devices (x n) against the host's figures.
The chip's figures and calibration live in training/flops.py CHIPS; this module only reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Bytes each device sends per result byte, for a group of n devices.
MOVED = {
  'all-gather': lambda n: (n - 1) / n,
  'all-reduce': lambda n: 2 * (n - 1) / n,
  'reduce-scatter': lambda n: float(n - 1),
  'all-to-all': lambda n: (n - 1) / n,
  'collective-permute': lambda n: 1.0,
}


@dataclasses.dataclass(frozen=True)
class CollectiveKey:
  op: str
  axes: tuple[str, ...]  # mesh axes its groups run over
  group: int  # devices per group
  hosts: int  # most hosts one group reaches (1: stays on ICI / NVLink)


@dataclasses.dataclass
class Profile:
  """What the plan search reads from one compiled step, per device (times are runs per step)."""

  flops: float
  bytes_accessed: float
  memory: float  # arguments + outputs - donated aliases + temporaries
  argument_bytes: float
  temp_bytes: float
  collectives: dict[CollectiveKey, tuple[float, float]]  # key -> (runs, result bytes over all runs)
  # what the backward keeps, from JAX's residuals (planning/residuals.py), for targets the compile is not on;
  # 0 where not modelled
  kept_fused: float = 0.0
  kept_written: float = 0.0
  kept_largest: float = 0.0
  # a pipeline's bubble, (S - 1) / (M + S - 1): the share of its iterations in which a stage computes on nothing.
  # The compiled program runs every stage in every iteration, so the FLOPs (and the predicted time) include it.
  bubble: float = 0.0

  def combine(self, other: Profile, a: float, b: float) -> Profile:
    """a x self + b x other, figure by figure (the layer extrapolation: P1 + (L-1)(P2 - P1)), clamped at 0."""
    mix = lambda x, y: max(0.0, a * x + b * y)
    keys = set(self.collectives) | set(other.collectives)
    coll = {
      k: (
        mix(self.collectives.get(k, (0, 0))[0], other.collectives.get(k, (0, 0))[0]),
        mix(self.collectives.get(k, (0, 0))[1], other.collectives.get(k, (0, 0))[1]),
      )
      for k in keys
    }
    return Profile(
      mix(self.flops, other.flops),
      mix(self.bytes_accessed, other.bytes_accessed),
      mix(self.memory, other.memory),
      mix(self.argument_bytes, other.argument_bytes),
      mix(self.temp_bytes, other.temp_bytes),
      {k: v for k, v in coll.items() if v[0] > 0},
      mix(self.kept_fused, other.kept_fused),
      mix(self.kept_written, other.kept_written),
      mix(self.kept_largest, other.kept_largest),
    )


@dataclasses.dataclass
class Prediction:
  step_s: float
  compute_s: float
  collective_s: float
  by_axes: dict[str, float]  # 'fsdp', 'data+fsdp', ... (DCN ones marked) -> seconds
  fits: bool
  memory_gib: float  # arguments + outputs - aliases + temporaries (or the residual model's estimate)
  state_gib: float  # arguments + outputs - aliases (parameters, optimizer state, batch)
  memory_range: tuple[float, float] | None = None  # the residual model's bounds, GiB


def predict(
  profile: Profile,
  chip: Any,
  num_devices: int,
  memory_headroom: float = 0.9,
  temporaries_known: bool = True,
  bytes_known: bool = True,
) -> Prediction:
  """The predicted step time of a profile on `num_devices` of `chip` (a training.flops.Chip).

  Fits: memory <= headroom x the chip's. `temporaries_known=False` (a GPU/TPU target compiled on CPU: the
  CPU's temporaries are 2-3x a GPU's and blind to remat, even with attention traced as on the GPU,
  models/attention.gpu_stand_in): the memory is modelled from what the backward keeps (the profile's kept_*,
  planning/residuals.py): state + (fused + written) / 2 + largest, the range from fused to written; without
  those figures the state alone is checked, with temporaries capped at half the chip's memory.
  `bytes_known=False` (likewise): the compute term is the FLOPs alone."""
  share = num_devices if chip.shared else 1
  flop_s = profile.flops / (chip.peak_tflops * 1e12 * chip.compute_eff)
  # compiled on CPU for a GPU/TPU: CPU fusion and XLA attention's L x L scores make the bytes accessed
  # unrepresentative (Llama 1.24B: 2.5x the FLOP time), so the FLOPs alone set the compute term
  byte_s = profile.bytes_accessed / (chip.hbm_gbps * 1e9) if bytes_known else 0.0
  compute = max(flop_s, byte_s) * share
  by_axes: dict[str, float] = {}
  for key, (runs, nbytes) in profile.collectives.items():
    dcn = key.hosts > 1
    bw = (chip.dcn_gbps if dcn else chip.ici_gbps) * 1e9 * chip.link_eff
    lat = (chip.dcn_latency_us if dcn else chip.latency_us) * 1e-6
    t = runs * lat + MOVED[key.op](key.group) * nbytes * share / bw
    name = '+'.join(key.axes) + (' (DCN)' if dcn else '')
    by_axes[name] = by_axes.get(name, 0.0) + t
  collective = sum(by_axes.values())
  gib = profile.memory / 2**30
  state = (profile.memory - profile.temp_bytes) / 2**30
  bounds = None
  if temporaries_known:
    need = gib
  elif profile.kept_written > 0:
    low, high = (state + (k + profile.kept_largest) / 2**30 for k in (profile.kept_fused, profile.kept_written))
    need = gib = (low + high) / 2
    bounds = (low, high)
  else:
    need = state + min(profile.temp_bytes / 2**30, chip.memory_gib / 2)
  step = chip.step_overhead_us * 1e-6 + compute + collective
  return Prediction(step, compute, collective, by_axes, need <= chip.memory_gib * memory_headroom, gib, state, bounds)


def mfu(model_flops: float, step_s: float, num_devices: int, chip: Any) -> float:
  """Model FLOPs utilisation of a predicted (or measured) step: model FLOPs / (time x devices x peak)."""
  return model_flops / (step_s * num_devices * chip.peak_tflops * 1e12)


def summarize(profile: Profile) -> Mapping[str, tuple[float, float]]:
  """'all-gather over fsdp' -> (runs, bytes) for the table."""
  out: dict[str, tuple[float, float]] = {}
  for k, (runs, nbytes) in profile.collectives.items():
    name = f'{k.op} {"+".join(k.axes)}' + (' DCN' if k.hosts > 1 else '')
    r, b = out.get(name, (0.0, 0.0))
    out[name] = (r + runs, b + nbytes)
  return out
