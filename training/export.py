"""Exporting trained weights: LoRA adapters merged into the base kernels, as a params-only checkpoint."""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models import lora
from training.trainer import Trainer, TrainState


def export_merged_lora(trainer: Trainer, state: TrainState, workdir: str) -> str:
  """Saves the params with LoRA adapters folded into the base kernels, as a params-only checkpoint
  (<workdir>/export/0/state) that `init_from` reads with the base model's config (no LoRA)."""
  def merge(params, rest):
    model = lora.merge(nnx.merge(trainer.graphdef, params, rest))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
  merged = jax.jit(merge)(state.params, state.model_state)
  directory = os.path.join(os.path.abspath(workdir), 'export')
  with ocp.StandardCheckpointer() as saver:
    saver.save(os.path.join(directory, '0', 'state'), {'params': merged}, force=True)
    saver.wait_until_finished()
  return directory
