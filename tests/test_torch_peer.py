"""benchmarks/torch_peer.py on CPU (eager, float32, 1 warm-up + 2 timed steps): tiny GPT-2 and ViT run as
the throughput benchmark runs them (a child process); its first loss is our model's loss on the same
weights and batch (mask-weighted, no label shifting); the other families and tasks start near ln(classes);
what it cannot do (no torchvision, no GPU, a bad spec) is reported in RESULT.json, not a crash."""

import importlib.util
import json
import math
import os
import subprocess
import sys

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from configs import bert as bert_config  # noqa: E402
from configs import gpt2 as gpt2_config  # noqa: E402
from configs import llama as llama_config  # noqa: E402
from configs import moe as moe_config  # noqa: E402
from configs import resnet as resnet_config  # noqa: E402
from configs import vit as vit_config  # noqa: E402
from models import hf_import  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

PEER = os.path.join(ROOT, 'benchmarks', 'torch_peer.py')
B = 4


def load_peer():
  module_spec = importlib.util.spec_from_file_location('torch_peer', PEER)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


peer = load_peer()


def spec_for(config_file, arg, **overrides):
  """(spec, config) as the throughput benchmark builds them, for CPU smoke runs."""
  c = config_file.get_config(arg)
  m = c.model
  spec = dict(
    family=m.name,
    task=c.task,
    optim=c.optim.to_dict(),
    remat=False,
    dtype='float32',
    steps=2,
    warmup=1,
    compile=False,
    device='cpu',
  )
  if m.name == 'resnet':
    spec['resnet'] = dict(block=m.block, stage_sizes=list(m.stage_sizes), width=m.width, num_classes=m.num_classes)
  else:
    spec['hf_config'] = models.HF_FAMILIES[m.name].to_config(m)
  if m.get('num_experts'):
    spec['moe_aux'] = [m.top_k, m.aux_loss_weight, m.router_z_loss_weight]
  spec.update(overrides)
  return spec, c


def make_batch(c, seed=0):
  """A batch of the task's fields, with some masked-out positions or examples."""
  rng = np.random.default_rng(seed)
  m, task = c.model, c.task
  if task == 'classification':
    s, k = m.image_size, m.num_classes
    return dict(
      image=rng.normal(size=(B, s, s, m.channels)).astype(np.float32),
      label=rng.integers(0, k, B).astype(np.int32),
      mask=np.array([1, 1, 1, 0], np.float32),
    )
  L = c.dataset.seq_len
  tokens = lambda: rng.integers(0, m.vocab_size, (B, L)).astype(np.int32)
  mask = np.ones((B, L), np.float32)
  mask[1::2, L // 2 :] = 0  # half the rows padded after the middle
  if task == 'lm':
    return dict(inputs=tokens(), targets=tokens(), mask=mask)
  batch = dict(inputs=tokens(), input_mask=mask.astype(np.int32), token_types=np.zeros((B, L), np.int32))
  if task == 'mlm':
    return dict(batch, targets=tokens(), mask=mask * (rng.random((B, L)) < 0.3))
  return dict(batch, label=rng.integers(0, m.num_classes, B).astype(np.int32), mask=np.ones(B, np.float32))


def write(tmp_path, spec, batch) -> list[str]:
  """The script's arguments for `spec` and `batch` written under tmp_path; RESULT.json is the last."""
  paths = [str(tmp_path / f) for f in ('spec.json', 'batch.npz', 'out.json')]
  with open(paths[0], 'w') as f:
    json.dump(spec, f)
  np.savez(paths[1], **batch)
  return ['--spec', paths[0], '--batch', paths[1], '--out', paths[2]]


def run_script(tmp_path, spec, batch):
  """(exit status, RESULT.json) of the script in a child process, as the benchmark runs it."""
  args = write(tmp_path, spec, batch)
  r = subprocess.run([sys.executable, PEER, *args], capture_output=True, text=True, timeout=300)
  assert os.path.exists(args[-1]), r.stderr[-2000:]
  with open(args[-1]) as f:
    return r.returncode, json.load(f)


def run_main(tmp_path, spec, batch):
  """The same, in this process (the script's main(): no second torch import)."""
  args = write(tmp_path, spec, batch)
  status = peer.main(args)
  with open(args[-1]) as f:
    return status, json.load(f)


def check_ran(result, steps=2):
  assert result['ok'], result
  assert len(result['step_times_s']) == steps and result['step_time_s'] > 0 and result['first_step_s'] > 0
  assert all(math.isfinite(x) for x in result['losses'])
  assert result['compiled'] is False and result['peak_memory_bytes'] is None and result['device'] == 'cpu'


def our_loss(cfg, hf_dir, batch):
  """Our model with the HF directory's weights (models/hf_import.py), our lm loss on `batch`, in numpy."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.create(cfg.model, nnx.Rngs(0))))
  abstract = nnx.to_pure_dict(state)
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
  loaded, _ = hf_import.import_params(
    hf_import.HFDir(hf_dir), models.HF_FAMILIES[cfg.model.name], cfg.model, abstract, shardings
  )
  nnx.replace_by_pure_dict(state, loaded)
  logits = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, batch['inputs']), np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  xent = -np.take_along_axis(logp, batch['targets'][..., None], -1)[..., 0]
  return float((xent * batch['mask']).sum() / batch['mask'].sum())


def test_gpt2_first_loss_is_ours_on_the_same_weights(tmp_path):
  spec, c = spec_for(gpt2_config, 'tiny', init_from=str(tmp_path / 'hf'))
  torch.manual_seed(1)
  hf = transformers.GPT2LMHeadModel(transformers.AutoConfig.for_model(**spec['hf_config']))
  with torch.no_grad():  # logits far from uniform: a wrong target alignment or mask would show
    hf.transformer.wte.weight.mul_(20.0)
  hf.save_pretrained(spec['init_from'])
  batch = make_batch(c)
  rc, result = run_script(tmp_path, spec, batch)
  assert rc == 0
  check_ran(result)
  assert result['model'] == 'GPT2LMHeadModel' and result['num_params'] == models.gpt2.num_params(c.model)
  ours = our_loss(c, spec['init_from'], batch)
  assert abs(ours - math.log(c.model.vocab_size)) > 0.5  # the check below is not a coincidence at ln(V)
  np.testing.assert_allclose(result['losses'][0], ours, rtol=1e-5)


def test_vit_script_starts_near_ln_classes(tmp_path):
  spec, c = spec_for(vit_config, 'tiny', optim=dict(name='sgd', lr=0.01, momentum=0.9, grad_clip=1.0))
  rc, result = run_script(tmp_path, spec, make_batch(c))
  assert rc == 0
  check_ran(result)
  assert result['model'] == 'ViTForImageClassification'
  assert abs(result['losses'][0] - math.log(c.model.num_classes)) < 0.3


def our_num_params(cfg) -> int:
  abstract = nnx.eval_shape(lambda: models.create(cfg.model, nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
  'config_file,arg,classes',
  [
    (llama_config, 'tiny', None),
    (moe_config, 'tiny', None),
    (bert_config, 'tiny', None),
    (bert_config, 'tiny,classify', 2),
    *[(importlib.import_module(f'configs.{name}'), 'tiny', None) for name in ('qwen2', 'qwen3', 'mistral', 'gemma')],
    *[(importlib.import_module(f'configs.{name}'), 'tiny', None) for name in ('gemma2', 'gemma3', 'phi3', 'olmo2')],
    *[(importlib.import_module(f'configs.{name}'), 'tiny', None) for name in ('qwen3_moe', 'gpt_oss', 'deepseek_v3')],
  ],
  ids=lambda v: getattr(v, '__name__', str(v)).removeprefix('configs.'),
)
def test_other_families_run_in_process(config_file, arg, classes):
  """Every family the benchmark times: the class its config.json names, as many parameters as ours."""
  spec, c = spec_for(config_file, arg, remat=True)
  result = peer.run(spec, make_batch(c))
  check_ran(result)
  assert result['model'] == spec['hf_config'].get('architectures', [result['model']])[0]
  assert result['num_params'] == our_num_params(c)
  # At init the logits are near zero: the loss is near ln(classes) (MoE adds its small weighted aux losses).
  assert abs(result['losses'][0] - math.log(classes or c.model.vocab_size)) < 0.3
  if c.model.name in ('gemma2', 'gpt_oss'):  # no SDPA path in transformers: said, not hidden
    assert any('eager attention' in n for n in result['notes']), result['notes']


def test_the_peer_recomputes_what_our_policy_recomputes_or_says_how_it_differs():
  """HF's only recomputation is whole layers: off for 'none' and 'dots' (which reruns no matmul), on for 'full'
  and 'attention' (noted: ours reruns the MLPs only); a ResNet v1 (stride on the 1x1 conv) has no torchvision peer."""
  for policy, layers_rerun, note in (
    ('none', False, None),
    ('dots', False, 'no gradient checkpointing'),
    ('attention', True, 'reruns whole layers'),
    ('full', True, None),
  ):
    spec, _ = spec_for(llama_config, 'tiny', remat=policy in ('full', 'attention'), remat_policy=policy)
    notes = []
    model = peer.build_hf(torch, spec, notes)
    assert model.is_gradient_checkpointing == layers_rerun, policy
    assert (note is None and not notes) or (note and any(note in n for n in notes)), (policy, notes)
  spec, _ = spec_for(resnet_config, 'tiny')
  spec['resnet'].update(block='bottleneck', stride_in_1x1=True)
  with pytest.raises(peer.SpecError, match='stride_in_1x1=True .* has no torchvision peer'):
    peer.build_resnet(torch, spec, [])


def test_resnet_runs_or_is_skipped_without_torchvision(tmp_path):
  spec, c = spec_for(resnet_config, 'tiny')
  rc, result = run_main(tmp_path, spec, make_batch(c))
  assert rc == 0
  try:
    import torchvision  # noqa: F401
  except Exception:  # noqa: BLE001 (missing, or built for another torch)
    assert not result['ok'] and result['skipped'] and 'torchvision' in result['reason']
  else:
    check_ran(result)
    assert result['num_params'] == models.resnet.num_params(c.model)


def test_what_cannot_run_is_a_reason(tmp_path):
  spec, c = spec_for(gpt2_config, 'tiny')
  batch = make_batch(c)
  rc, result = run_main(tmp_path, dict(spec, family=''), batch)
  assert (rc, result['ok']) == (2, False) and "family=''" in result['reason']
  headless = {k: v for k, v in spec['hf_config'].items() if k != 'architectures'}
  with pytest.raises(peer.SpecError, match=r'hf_config.architectures=None must name the one causal LM class'):
    peer.run(dict(spec, hf_config=headless), batch)
  rc, result = run_main(tmp_path, dict(spec, hf_config=dict(spec['hf_config'], architectures=['GPT9000LM'])), batch)
  assert (rc, result['ok'], result.get('skipped')) == (0, False, True) and 'has no GPT9000LM' in result['reason']
  with pytest.raises(peer.SpecError, match=r"batch has no field\(s\) \['targets'\]"):
    peer.run(spec, {k: v for k, v in batch.items() if k != 'targets'})
  with pytest.raises(peer.SpecError, match="task='classification' does not fit family 'gpt2'"):
    peer.run(dict(spec, task='classification'), batch)
  if not torch.cuda.is_available():
    with pytest.raises(peer.Skip, match='sees no GPU'):
      peer.run(dict(spec, device='cuda'), batch)


def test_the_peer_accumulates_micro_batches_to_the_big_step():
  """grad_accum_steps=2 (rows split as ours, half the rows padded): the same losses before the first step and after
  the last as the unsplit batch, in float32 on the CPU."""
  spec, c = spec_for(gpt2_config, 'tiny')
  batch = make_batch(c)
  big = peer.run(dict(spec), batch)
  acc = peer.run(dict(spec, grad_accum_steps=2), batch)
  check_ran(acc)
  np.testing.assert_allclose(acc['losses'], big['losses'], rtol=1e-5)
  assert big['losses'][1] != big['losses'][0]  # the steps changed the weights
