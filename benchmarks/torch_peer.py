r"""The PyTorch peer of benchmarks/throughput.py: the same architecture, batch, loss and optimizer in
PyTorch (transformers / torchvision, torch.compile, bf16 autocast, SDPA attention, fused AdamW), timed.

  python benchmarks/torch_peer.py --spec SPEC.json --batch BATCH.npz --out RESULT.json

It runs in a child process beside a JAX process on the same GPU, so it imports nothing from JAX or from
this project (the model files import JAX): the spec carries everything. The parent builds it
(throughput.py's peer_spec; the architecture from the family's `to_hf_config`, models/<family>.py).

SPEC.json
  family     'vit' | 'bert' | 'resnet', or any causal LM family (gpt2, llama, qwen3, gemma3, moe, gpt_oss, ...)
  task       'lm' (the causal LMs) | 'classification' (vit, resnet) | 'mlm' | 'text_classification' (bert)
  hf_config  config.json as a dict (model_type, sizes, ...) for every family but resnet; a causal LM is the class
             its `architectures` names (GPT2LMHeadModel, Qwen3ForCausalLM, GptOssForCausalLM, ...), the others
             ViTForImageClassification, BertForMaskedLM or BertForSequenceClassification; float32 parameters,
             SDPA attention where transformers has it for the class (else its eager attention, noted)
  moe_aux    for a sparse family: [top_k, load-balancing weight, router z weight], the zoo's (config.model)
  resnet     for resnet: {"block": "basic"|"bottleneck", "stage_sizes": [...], "width": 64, "num_classes": K}
             (torchvision's ResNet; other widths and numbers of stages from its blocks)
  optim      config.optim as a dict, every field of its optimizer set (as configs/schema.py completes it):
             name 'adamw' (lr, b1, b2, eps, weight_decay, grad_clip) or 'sgd' (lr, momentum, grad_clip); the lr
             is constant (schedules do not change the speed); other keys (warmup_steps, ...) are ignored
  remat      gradient checkpointing (HF's gradient_checkpointing_enable; resnet: not available, noted);
             remat_policy: ours, named in a note where the two recompute differently
  dtype      'bfloat16' (torch.autocast) | 'float32'; parameters and optimizer state stay float32
  steps      N timed steps (default 10); warmup: W untimed steps before them (default 3; the first
             step, which compiles, is always one of them)
  compile    torch.compile the model with the loss (default true; a failure falls back to eager, noted)
  device     'cuda' | 'cpu' (default 'cuda')
  tf32       float32 matmuls in TF32 on cuda, as XLA does on GPU by default (default true)
  init_from  optional: a Hugging Face model directory to load instead of a fresh init (same class)
  grad_accum_steps  micro-batches per optimizer step (default 1), split as ours are (micro-batch i: rows i,
             i + n, ...): each micro-batch's loss sum over the whole batch's mask sum (aux losses / n) is
             backpropagated into the summed .grad, then one clip and one optimizer step: the same work as ours
BATCH.npz: the global batch our train step consumes, as numpy arrays:
  lm                   inputs, targets int32 (B, L), mask float32 (B, L) (segment_ids/positions, if
                       present, are ignored: one document per row)
  classification       image float32 (B, H, W, C) (made NCHW; channels_last for resnet), label int32 (B,),
                       mask float32 (B,)
  mlm                  inputs, targets, mask, input_mask, token_types (B, L)
  text_classification  inputs, input_mask, token_types (B, L), label, mask (B,)
The loss is ours (training/tasks.py): sum(mask * cross-entropy(float32 logits, targets or label)) /
max(sum(mask), 1), plus for a sparse family the weighted load-balancing and router z losses of every layer
(spec moe_aux) from the router logits, computed as the zoo does (HF's own aux loss is computed too, unused).
Weight decay applies to >= 2-D parameters.
RESULT.json
  {"ok": true, "step_time_s": median, "step_times_s": [...], "peak_memory_bytes": int (cuda) | null,
   "first_step_s": the first step (compile included), "losses": [first step's, last step's],
   "torch": version, "device": name, "compiled": bool, "notes": [...], "model": class name,
   "num_params": int, "transformers": version | null}
  or {"ok": false, "reason": "...", "skipped": true (torch / transformers / torchvision missing, no GPU),
      "oom": true (CUDA out of memory)}
Exit status 0 when RESULT.json says ok, skipped or oom; 1 on any other error (RESULT.json still says
why, with the traceback's tail); 2 for a spec that is not understood.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np

# Every other family is a causal LM ('lm'), the class its config.json's `architectures` names.
TASKS = {
  'vit': ('classification',),
  'bert': ('mlm', 'text_classification'),
  'resnet': ('classification',),
}
HF_CLASSES = {
  ('vit', 'classification'): 'ViTForImageClassification',
  ('bert', 'mlm'): 'BertForMaskedLM',
  ('bert', 'text_classification'): 'BertForSequenceClassification',
}
FIELDS = {
  'lm': ('inputs', 'targets', 'mask'),
  'classification': ('image', 'label', 'mask'),
  'mlm': ('inputs', 'targets', 'mask', 'input_mask', 'token_types'),
  'text_classification': ('inputs', 'input_mask', 'token_types', 'label', 'mask'),
}


class SpecError(ValueError):
  """A spec or batch this script does not understand; the message names the culprit."""


# The config.optim fields each optimizer reads (the spec carries them: this process cannot read configs/schema.py).
OPTIM_FIELDS = {'adamw': ('lr', 'b1', 'b2', 'eps', 'weight_decay', 'grad_clip'), 'sgd': ('lr', 'momentum', 'grad_clip')}


class Skip(Exception):
  """The peer cannot run here (a missing package, no GPU): reported, not an error."""


def check_spec(spec: dict, batch: dict[str, np.ndarray]) -> dict:
  """The spec with defaults filled in; SpecError naming the first bad field."""
  family, task = spec.get('family'), spec.get('task')
  if not isinstance(family, str) or not family:
    raise SpecError(f'spec family={family!r} must name the model family')
  if task not in TASKS.get(family, ('lm',)):
    raise SpecError(f'spec task={task!r} does not fit family {family!r}; it trains {list(TASKS.get(family, ("lm",)))}')
  key = 'resnet' if family == 'resnet' else 'hf_config'
  if not isinstance(spec.get(key), dict):
    raise SpecError(f'spec has no {key!r} dict for family {family!r}')
  if task == 'lm' and not (isinstance(arch := spec[key].get('architectures'), list) and len(arch) == 1):
    raise SpecError(f'spec hf_config.architectures={arch!r} must name the one causal LM class of family {family!r}')
  aux = spec.get('moe_aux')
  if aux is not None and not (isinstance(aux, list | tuple) and len(aux) == 3):
    raise SpecError(f'spec moe_aux={aux!r} must be [top_k, load-balancing weight, router z weight]')
  if family == 'resnet':
    missing = [k for k in ('block', 'stage_sizes', 'width', 'num_classes') if k not in spec['resnet']]
    if missing or spec['resnet']['block'] not in ('basic', 'bottleneck'):
      raise SpecError(f'spec resnet={spec["resnet"]!r}: needs block basic|bottleneck, stage_sizes, width, num_classes')
  optim = spec.get('optim') or {}
  if optim.get('name') not in OPTIM_FIELDS:
    raise SpecError(f'spec optim.name={optim.get("name")!r} is not known; known: {sorted(OPTIM_FIELDS)}')
  if missing := [k for k in OPTIM_FIELDS[optim['name']] if k not in optim]:
    raise SpecError(f'spec optim has no {missing} ({optim["name"]} reads them; the config has them all)')
  out = dict(dict(remat=False, dtype='float32', steps=10, warmup=3, compile=True, device='cuda', tf32=True), **spec)
  if out['dtype'] not in ('bfloat16', 'float32'):
    raise SpecError(f"spec dtype={out['dtype']!r} is not known; known: ['bfloat16', 'float32']")
  if out['device'] not in ('cuda', 'cpu'):
    raise SpecError(f"spec device={out['device']!r} is not known; known: ['cpu', 'cuda']")
  if int(out['steps']) < 1 or int(out['warmup']) < 0:
    raise SpecError(f'spec steps={out["steps"]} must be >= 1 and warmup={out["warmup"]} >= 0')
  n, rows = int(out.setdefault('grad_accum_steps', 1)), len(next(iter(batch.values())))
  if n < 1 or rows % n:
    raise SpecError(f'spec grad_accum_steps={n} must be >= 1 and divide the batch of {rows} rows')
  missing = [f for f in FIELDS[task] if f not in batch]
  if missing:
    raise SpecError(f'batch has no field(s) {missing} that task {task!r} needs; it has {sorted(batch)}')
  return out


# --- Model --------------------------------------------------------------------------------------------


def build_hf(torch: Any, spec: dict, notes: list[str]) -> Any:
  try:
    import transformers
  except ImportError as e:
    raise Skip(f'transformers is not installed ({e})') from None
  lm = spec['task'] == 'lm'
  name = spec['hf_config']['architectures'][0] if lm else HF_CLASSES[spec['family'], spec['task']]
  if not hasattr(transformers, name):
    raise Skip(f'transformers {transformers.__version__} has no {name}')
  cls = getattr(transformers, name)

  def build(attention: str) -> Any:
    if spec.get('init_from'):
      return cls.from_pretrained(spec['init_from'], attn_implementation=attention, dtype=torch.float32)
    d = dict(spec['hf_config'])
    return cls(transformers.AutoConfig.for_model(d.pop('model_type'), attn_implementation=attention, **d))

  try:
    model = build('sdpa')
  except ValueError as e:  # a class without an SDPA path (GPT-OSS's sinks) says so when built
    if 'scaled_dot_product_attention' not in str(e):
      raise
    model = build('eager')
  if model.config._attn_implementation != 'sdpa':  # also where the class chose for itself (Gemma 2's soft cap)
    notes.append(f"{name} runs transformers' {model.config._attn_implementation} attention (it has no SDPA path)")
  if spec.get('init_from'):
    notes.append(f'weights from {spec["init_from"]}')
  policy = spec.get('remat_policy')
  if policy == 'dots':
    notes.append(
      "no gradient checkpointing: ours (remat 'dots') keeps every matmul output and recomputes no matmul; "
      "HF's only checkpointing reruns whole layers"
    )
  elif policy == 'attention' and spec['remat']:
    notes.append("gradient checkpointing reruns whole layers; ours (remat 'attention') reruns the MLPs only")
  if spec['remat']:  # transformers >= 5.23 names it activation_checkpointing_enable
    kw = {'use_reentrant': False}
    if hasattr(model, 'activation_checkpointing_enable'):
      model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
      model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
  experts = getattr(model.config, '_experts_implementation', None)
  if spec.get('moe_aux') and experts:
    notes.append(f'experts implementation {experts!r} (dropless)')
  return model


def build_resnet(torch: Any, spec: dict, notes: list[str]) -> Any:
  if spec['resnet'].get('stride_in_1x1') and spec['resnet']['block'] != 'basic':
    raise SpecError(
      'stride_in_1x1=True (ResNet v1: the stride on the first 1x1 conv) has no torchvision peer '
      '(v1.5: the stride on the 3x3 conv)'
    )
  try:
    from torchvision.models import resnet as tv
  except Exception as e:  # ImportError, or a torchvision built for another torch (its ops fail to register)
    raise Skip(f'torchvision is not usable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""})') from None
  r = spec['resnet']
  block = tv.BasicBlock if r['block'] == 'basic' else tv.Bottleneck
  stages, width = list(r['stage_sizes']), int(r['width'])
  model = tv.ResNet(block, stages if len(stages) == 4 else [1, 1, 1, 1], num_classes=r['num_classes'])
  if len(stages) != 4 or width != 64:  # torchvision fixes 4 stages of 64 * 2**i: rebuild them from its blocks
    model.inplanes = width
    model.conv1 = torch.nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = torch.nn.BatchNorm2d(width)
    layers = [model._make_layer(block, width * 2**i, n, stride=1 if i == 0 else 2) for i, n in enumerate(stages)]
    model.layer1 = torch.nn.Sequential(*layers)
    model.layer2 = model.layer3 = model.layer4 = torch.nn.Identity()
    model.fc = torch.nn.Linear(width * 2 ** (len(stages) - 1) * block.expansion, r['num_classes'])
    notes.append(f'torchvision blocks at width {width}, stages {stages} (default init)')
  if spec['remat']:
    notes.append('remat ignored: torchvision ResNet has no gradient checkpointing')
  return model


def to_device(torch: Any, spec: dict, batch: dict[str, np.ndarray]) -> dict[str, Any]:
  out = {}
  for k in FIELDS[spec['task']]:
    x = torch.from_numpy(np.asarray(batch[k]))
    if k == 'image':  # NHWC -> NCHW; the permuted view of NHWC memory is channels_last already
      x = x.float().permute(0, 3, 1, 2)
      x = x.contiguous(memory_format=torch.channels_last if spec['family'] == 'resnet' else torch.contiguous_format)
    elif k == 'mask':
      x = x.float()
    else:
      x = x.long()
    out[k] = x.to(spec['device'])
  return out


def moe_aux_loss(torch: Any, router_logits: Any, k: int, lb_weight: float, z_weight: float) -> Any:
  """The zoo's aux loss (models/moe.py route): per layer E * sum_e(f_e * p_e) (f_e: share of the top-k
  assignments, p_e: mean router probability) and mean(logsumexp(logits)^2), weighted, summed over layers."""
  total = 0.0
  for logits_TE in router_logits:
    logits_TE = logits_TE.float()
    probs_TE = logits_TE.softmax(-1)
    E = probs_TE.shape[-1]
    choice_TKE = torch.nn.functional.one_hot(probs_TE.topk(k, dim=-1).indices, E).float()
    share_E = choice_TKE.mean(0).sum(0) / k
    total = total + lb_weight * E * (share_E * probs_TE.mean(0)).sum()
    total = total + z_weight * torch.logsumexp(logits_TE, -1).pow(2).mean()
  return total


def loss_fn(torch: Any, spec: dict, model: Any, b: dict[str, Any], weight: Any = None, parts: int = 1) -> Any:
  """Our loss: mask-weighted mean cross-entropy of float32 logits (no HF label shifting), + MoE aux. One of
  `parts` micro-batches: the cross-entropy sum over the whole batch's `weight`, the aux losses over `parts`."""
  task, family, aux = spec['task'], spec['family'], 0.0
  if task == 'lm':
    moe = bool(spec.get('moe_aux'))
    out = model(input_ids=b['inputs'], use_cache=False, **({'output_router_logits': True} if moe else {}))
    logits, target = out.logits, b['targets']
    if moe:
      aux = moe_aux_loss(torch, out.router_logits, *spec['moe_aux'])
  elif task == 'classification':
    out = model(b['image']) if family == 'resnet' else model(pixel_values=b['image'])
    logits, target = getattr(out, 'logits', out), b['label']
  else:
    logits = model(input_ids=b['inputs'], attention_mask=b['input_mask'], token_type_ids=b['token_types']).logits
    target = b['targets'] if task == 'mlm' else b['label']
  xent = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction='none')
  mask = b['mask'].flatten()
  weight = mask.sum().clamp(min=1.0) if weight is None else weight
  return (xent * mask).sum() / weight + aux / parts


def make_optimizer(torch: Any, spec: dict, model: Any, notes: list[str]) -> Any:
  o, cuda = spec['optim'], spec['device'] == 'cuda'
  params = [p for p in model.parameters() if p.requires_grad]
  if o['name'] == 'adamw':
    groups = [
      {'params': [p for p in params if p.ndim >= 2], 'weight_decay': o['weight_decay']},
      {'params': [p for p in params if p.ndim < 2], 'weight_decay': 0.0},
    ]
    return torch.optim.AdamW(
      groups,
      lr=o['lr'],
      betas=(o['b1'], o['b2']),
      eps=o['eps'],
      **({'fused': True} if cuda else {}),
    )
  momentum = o['momentum'] or 0.0
  try:
    return torch.optim.SGD(params, lr=o['lr'], momentum=momentum, **({'fused': True} if cuda else {}))
  except (RuntimeError, TypeError, ValueError) as e:
    notes.append(f'fused SGD unavailable ({e}); foreach')
    return torch.optim.SGD(params, lr=o['lr'], momentum=momentum)


# --- The run ------------------------------------------------------------------------------------------


def run(spec: dict, batch: dict[str, np.ndarray]) -> dict:
  """Builds, warms up and times the peer; the RESULT.json dict. Raises Skip, SpecError, or the error."""
  spec = check_spec(spec, batch)
  try:
    import torch
  except ImportError as e:
    raise Skip(f'torch is not installed ({e})') from None
  device, notes = spec['device'], []
  cuda = device == 'cuda'
  if cuda and not torch.cuda.is_available():
    raise Skip(
      f'device cuda asked for, but torch {torch.__version__} sees no GPU (built for CUDA {torch.version.cuda})'
    )
  if cuda and spec['tf32']:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    notes.append('float32 matmuls and convs in TF32')
  extra = sorted(set(batch) - set(FIELDS[spec['task']]))
  if extra:
    notes.append(f'batch fields {extra} ignored')
  torch.manual_seed(0)
  build = build_resnet if spec['family'] == 'resnet' else build_hf
  model = build(torch, spec, notes)
  if spec['family'] == 'resnet':
    model = model.to(memory_format=torch.channels_last)
  model = model.to(device).train()
  num_params = sum(p.numel() for p in model.parameters())
  b = to_device(torch, spec, batch)
  opt = make_optimizer(torch, spec, model, notes)
  clip = float(spec['optim']['grad_clip'] or 0.0)
  params = [p for p in model.parameters() if p.requires_grad]
  autocast = dict(device_type=device, dtype=torch.bfloat16, enabled=spec['dtype'] == 'bfloat16')

  def forward(batch, weight, parts):  # model and loss: compiled together, the logits' upcast and xent fuse too
    return loss_fn(torch, spec, model, batch, weight, parts)

  parts = int(spec['grad_accum_steps'])
  layout = lambda v: torch.channels_last if spec['family'] == 'resnet' and v.dim() == 4 else torch.contiguous_format
  micro = [{k: v[i::parts].contiguous(memory_format=layout(v)) for k, v in b.items()} for i in range(parts)]
  weight = b['mask'].sum().clamp(min=1.0)

  def step(fwd):
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for mb in micro:  # gradients add up in .grad
      with torch.autocast(**autocast):
        part = fwd(mb, weight, parts)
      part.backward()
      loss = loss + part.detach()
    if clip > 0:
      torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    opt.step()
    return loss.detach()

  def sync():
    if cuda:
      torch.cuda.synchronize()

  compiled, runner = bool(spec['compile']), forward
  if compiled:
    try:
      runner = torch.compile(forward)
    except Exception as e:  # noqa: BLE001 (any failure: run eager and say why)
      compiled = False
      notes.append(f'torch.compile failed, eager: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}')
  t0 = time.perf_counter()
  try:
    first_loss = step(runner)
    sync()
  except torch.cuda.OutOfMemoryError:
    raise
  except Exception as e:  # noqa: BLE001
    if not compiled:
      raise
    compiled, runner = False, forward
    notes.append(
      f'torch.compile failed at the first step, eager: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
    )
    torch._dynamo.reset()
    t0 = time.perf_counter()
    first_loss = step(runner)
    sync()
  first_step_s = time.perf_counter() - t0
  for _ in range(int(spec['warmup']) - 1):
    step(runner)
  sync()
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  times, loss = [], first_loss
  if cuda:
    events = [
      (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(int(spec['steps']))
    ]
    for start, end in events:
      start.record()
      loss = step(runner)
      end.record()
    sync()
    times = [start.elapsed_time(end) / 1e3 for start, end in events]
  else:
    for _ in range(int(spec['steps'])):
      t0 = time.perf_counter()
      loss = step(runner)
      times.append(time.perf_counter() - t0)
  try:
    import transformers

    hf_version = transformers.__version__
  except ImportError:
    hf_version = None
  return dict(
    ok=True,
    step_time_s=statistics.median(times),
    step_times_s=times,
    peak_memory_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
    first_step_s=first_step_s,
    losses=[float(first_loss), float(loss)],
    torch=torch.__version__,
    device=torch.cuda.get_device_name() if cuda else 'cpu',
    compiled=compiled,
    notes=notes,
    model=type(model).__name__,
    num_params=num_params,
    transformers=hf_version,
  )


def _oom(e: BaseException) -> bool:
  return type(e).__name__ == 'OutOfMemoryError' or 'out of memory' in str(e).lower()


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--spec', required=True, help='SPEC.json (see the top of this file)')
  p.add_argument('--batch', required=True, help='BATCH.npz: the global batch as numpy arrays')
  p.add_argument('--out', required=True, help='RESULT.json to write')
  args = p.parse_args(argv)
  status = 0
  try:
    with open(args.spec) as f:
      spec = json.load(f)
    with np.load(args.batch) as npz:
      batch = {k: npz[k] for k in npz.files}
    result = run(spec, batch)
    if not all(math.isfinite(x) for x in result['losses']):
      result['notes'].append(f'non-finite loss: {result["losses"]}')
  except SpecError as e:
    result, status = dict(ok=False, reason=str(e)), 2
  except Skip as e:
    result = dict(ok=False, skipped=True, reason=str(e))
  except Exception as e:  # noqa: BLE001 (reported in RESULT.json, never a bare crash)
    if _oom(e):
      result = dict(ok=False, oom=True, reason=f'CUDA out of memory: {str(e).splitlines()[0] if str(e) else ""}')
    else:
      result, status = dict(ok=False, reason=f'{type(e).__name__}: {e}', traceback=traceback.format_exc()[-4000:]), 1
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  return status


if __name__ == '__main__':
  sys.exit(main())
