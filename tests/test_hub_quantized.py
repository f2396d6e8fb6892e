"""Checkpoints quantized as the hub ships them (models/hf_import.py): DeepSeek-V3's fp8 e4m3 weights with
weight_scale_inv block scales (Qwen3-MoE's -FP8 checkpoints have the same) and its multi-token-prediction layer,
GPT-OSS's MXFP4 experts. Tiny float models are quantized here by the formats' definitions (torch's float8_e4m3fn;
OCP MX e2m1 with e8m0 scales), written with the hub's key layout and quantization_config, and imported sharded so
that device slices start inside blocks. The import equals the import of the same weights dequantized by the
definition (bitwise; for GPT-OSS also transformers' own reading of the MXFP4 file), lies within the format's
rounding of the float model, gives transformers' logits on the dequantized weights, and exports to bfloat16
safetensors that transformers loads without a quantization_config."""

import json
import logging
import os

os.environ['HF_HUB_OFFLINE'] = '1'

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import models  # noqa: E402
from errors import HFImportError  # noqa: E402
from models import hf_import  # noqa: E402
from tests.conftest import export_hf  # noqa: E402
from tests.test_hf_families import import_hf, zoo_config  # noqa: E402
from tests.test_sparse_families import CASES, PARITY_ATOL, _randomise, config_file  # noqa: E402
from training import tasks  # noqa: E402

FP8_BLOCK = (16, 16)  # the hub's is 128 x 128; 16 puts several blocks, and partial edge ones, in a tiny model
E4M3_MAX = 448.0
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
MTP = 'model.layers.2.'  # DeepSeek's multi-token-prediction layer: num_hidden_layers=2, num_nextn_predict_layers=1

# family -> (config overrides on tests/test_sparse_families.py's, preset sharding the inputs of the quantized
# matrices mid-block: hidden 40 over fsdp=8 is 5 rows a device across 16-row blocks, 64 is 8 of a 32-value group)
QUANT_CASES = {
  'deepseek_v3': (dict(hidden_size=40, num_hidden_layers=2), 'fsdp,tiny'),
  'qwen3_moe': (dict(hidden_size=40), 'fsdp,tiny'),  # as Qwen's -FP8 checkpoints: the same block-scaled fp8
  'gpt_oss': (dict(hidden_size=64, intermediate_size=32), 'fsdp,tiny'),
}


def fp8_blocks(w):
  """(e4m3 tensor, float32 weight_scale_inv over the ceil grid, the dequantized float32 weight)."""
  (M, N), (bm, bn) = w.shape, FP8_BLOCK
  gm, gn = -(-M // bm), -(-N // bn)
  padded = np.zeros((gm * bm, gn * bn), np.float32)
  padded[:M, :N] = w
  amax = np.abs(padded.reshape(gm, bm, gn, bn)).max(axis=(1, 3))
  scale = (np.maximum(amax, 1e-12) / E4M3_MAX).astype(np.float32)
  full = np.repeat(np.repeat(scale, bm, 0), bn, 1)[:M, :N]
  q = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
  return q, scale, q.float().numpy() * full


def mxfp4_blocks(w_in_out):
  """A GPT-OSS expert tensor [E, in, out] -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32],
  the dequantized [E, in, out]): per 32 inputs the shared exponent floor(log2 amax) - 2 (e2m1's largest is 1.5 * 2^2),
  each value rounded to the nearest e2m1 (sign in bit 3), two per byte, the even index in the low nibble."""
  w = np.swapaxes(w_in_out, 1, 2)
  groups = w.reshape(*w.shape[:-1], -1, 32)
  amax = np.abs(groups).max(-1)
  exp = np.clip(np.floor(np.log2(np.maximum(amax, 2.0**-126))) - 2, -127, 127).astype(np.int32)
  x = groups / np.exp2(exp)[..., None]
  mag = np.abs(np.minimum(np.abs(x), 6.0))
  idx = np.abs(mag[..., None] - E2M1).argmin(-1) | np.where(x < 0, 8, 0)
  packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).astype(np.uint8)
  signed = np.concatenate([E2M1, -E2M1])
  deq = (signed[idx] * np.exp2(exp)[..., None]).reshape(w.shape).astype(np.float32)
  return packed, (exp + 127).astype(np.uint8), np.swapaxes(deq, 1, 2)


def write(path, tensors, config):
  """A checkpoint directory (numpy arrays and torch's float8 tensors, each its own copy)."""
  os.makedirs(path, exist_ok=True)
  tensors = {
    k: v.clone() if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v, order='C'))
    for k, v in tensors.items()
  }
  save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(config, f)
  return str(path)


def quantize(name, float_dir, root):
  """The float checkpoint as the hub lays out its quantized one, and the same weights dequantized: two dirs."""
  sd = {k: v.numpy() for k, v in load_file(os.path.join(float_dir, 'model.safetensors')).items()}
  with open(os.path.join(float_dir, 'config.json')) as f:
    config = json.load(f)
  quant, deq = {}, {}
  extra = {}
  if name == 'deepseek_v3':
    # the multi-token-prediction layer: a decoder layer (layer 1's weights) and its own norms and projection
    extra = {MTP + k.removeprefix('model.layers.1.'): v for k, v in sd.items() if k.startswith('model.layers.1.')}
    D = config['hidden_size']
    rng = np.random.default_rng(3)
    for part, shape in (('enorm', (D,)), ('hnorm', (D,)), ('eh_proj', (D, 2 * D)), ('shared_head.norm', (D,))):
      extra[f'{MTP}{part}.weight'] = rng.normal(size=shape).astype(np.float32)
    extra[f'{MTP}shared_head.head.weight'] = sd['lm_head.weight']
  if name != 'gpt_oss':  # every projection in fp8 (the router, norms, embedding and head stay float)
    for k, w in {**sd, **extra}.items():
      if k.endswith('proj.weight') or k.endswith('proj_with_mqa.weight'):
        q, scale, deq[k] = fp8_blocks(w)
        quant[k], quant[k + '_scale_inv'] = q, scale
      else:
        quant[k] = deq[k] = w
    deq = {k: v for k, v in deq.items() if k not in extra}  # transformers has no multi-token-prediction layer
    qcfg = dict(quant_method='fp8', fmt='e4m3', activation_scheme='dynamic', weight_block_size=list(FP8_BLOCK))
    config_q = dict(config, quantization_config=qcfg) | ({'num_nextn_predict_layers': 1} if extra else {})
  else:  # the experts in MXFP4, everything else float
    for k, w in sd.items():
      if k.endswith(('experts.gate_up_proj', 'experts.down_proj')):
        quant[k + '_blocks'], quant[k + '_scales'], deq[k] = mxfp4_blocks(w)
      else:
        quant[k] = deq[k] = w
    config_q = dict(config, quantization_config=dict(quant_method='mxfp4', modules_to_not_convert=['router']))
  qdir = write(root / 'quantized', quant, config_q)
  return qdir, write(root / 'dequantized', deq, config)


@pytest.fixture(scope='module', params=sorted(QUANT_CASES))
def quantized(request, tmp_path_factory):
  name = request.param
  cls, kwargs, *_ = CASES[name]
  overrides, arg = QUANT_CASES[name]
  torch.manual_seed(0)
  model = _randomise(transformers.AutoModelForCausalLM.from_config(cls(**dict(kwargs, **overrides))).eval())
  root = tmp_path_factory.mktemp(f'quant_{name}')
  model.save_pretrained(str(root / 'float'))
  qdir, ddir = quantize(name, str(root / 'float'), root)
  return name, arg, str(root / 'float'), qdir, ddir


def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _weights(trainer, path):
  """The params read from `path` into the trainer's shardings (the importer alone: no state built)."""
  t = trainer
  got = hf_import.import_weights(
    hf_import.HFDir(path),
    models.HF_FAMILIES[t.config.model.name],
    t.config.model,
    t.abstract.params,
    t.shardings.params,
    t.abstract.model_state,
    t.shardings.model_state,
  )
  return _flat(got.params)


def test_quantized_import_is_the_dequantized_weights(quantized, tmp_path, caplog):
  """Imported slice by slice under fsdp=8 (slices start inside blocks), a quantized checkpoint gives bitwise the
  parameters of its dequantized weights, each within the format's rounding of the float model's; logits within 1e-5
  of transformers on the dequantized weights; DeepSeek's multi-token-prediction layer is skipped with one line; the
  bfloat16 export loads in transformers, its weights those values in bfloat16, with no quantization_config."""
  name, arg, fdir, qdir, ddir = quantized
  with caplog.at_level(logging.INFO):
    trainer, state = import_hf(zoo_config(config_file(name), arg, qdir, scan_layers=name == 'gpt_oss'))
  ref, orig = _weights(trainer, ddir), _weights(trainer, fdir)
  if name == 'deepseek_v3':
    (line,) = [r.getMessage() for r in caplog.records if 'multi-token-prediction' in r.getMessage()]
    assert 'model.layers.2 ' in line and 'num_nextn_predict_layers=1' in line, line
  assert any(f'{name == "gpt_oss" and "mxfp4" or "fp8"} tensors dequantized' in r.getMessage() for r in caplog.records)
  # the format's rounding: e4m3 keeps 3 mantissa bits (half a step: 2^-4 relative; subnormal steps 2^-9 of a scale);
  # e2m1 is coarser (half a step up to 1/4 relative; below 0.5, a quarter of the shared power of two <= amax / 4)
  rtol, sub = (2.0**-4, 2.0**-10 / E4M3_MAX) if name != 'gpt_oss' else (0.25, 1 / 16)
  got_all = _flat(state.params)
  assert got_all.keys() == ref.keys() == orig.keys()
  changed = 0
  for path, got in got_all.items():
    want, float_w = ref[path], orig[path]
    assert np.array_equal(got, want), path
    np.testing.assert_allclose(got, float_w, rtol=rtol, atol=sub * np.abs(float_w).max(), err_msg=str(path))
    changed += not np.array_equal(got, float_w)
  assert changed >= (9 if name != 'gpt_oss' else 2), changed  # the quantized leaves differ from the float ones
  # transformers on the same weights dequantized
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
  if name == 'gpt_oss':  # transformers reads the MXFP4 file itself (dequantized on CPU): the same weights
    theirs_q = transformers.AutoModelForCausalLM.from_pretrained(
      qdir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).state_dict()
    assert all(torch.equal(theirs_q[k].float(), v) for k, v in hf_model.state_dict().items())
  tokens = np.random.default_rng(0).integers(0, 96, (2, 16))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  run = lambda p, s, t: tasks.eval_view(nnx.merge(trainer.graphdef, p, s))(t)
  ours, _ = jax.jit(run)(state.params, state.model_state, tokens)
  err = float(np.abs(np.asarray(ours) - theirs).max())
  print(f'{name}: max |logits diff| against transformers on the dequantized weights {err:.2e}')
  assert err < PARITY_ATOL, err
  # back to bfloat16 safetensors
  export_hf(trainer, state, tmp_path / 'bf16', dtype=jax.numpy.bfloat16)
  with open(tmp_path / 'bf16' / 'config.json') as f:
    exported_cfg = json.load(f)
  assert 'quantization_config' not in exported_cfg and exported_cfg.get('num_nextn_predict_layers', 0) == 0
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'bf16'), output_loading_info=True)
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys']), info
  assert {v.dtype for v in load_file(str(tmp_path / 'bf16' / 'model.safetensors')).values()} == {torch.bfloat16}
  want = hf_model.state_dict()  # (transformers keeps DeepSeek's correction bias in float32)
  for k, v in loaded.state_dict().items():
    assert torch.equal(v, want[k].to(torch.bfloat16).to(v.dtype)), k


def test_unknown_quantization_is_one_error_naming_the_file(tmp_path):
  write(
    tmp_path, {'w': np.zeros(2, np.float32)}, dict(model_type='gpt_oss', quantization_config={'quant_method': 'awq'})
  )
  with pytest.raises(HFImportError, match=r"config\.json: quantization_config\.quant_method='awq' is not one the zoo"):
    hf_import.HFDir(str(tmp_path))
