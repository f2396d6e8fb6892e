r"""Default: a small GPT-style LM on a synthetic order-2 Markov language, 8 devices (data x fsdp x tensor).

  python train.py --config configs/default.py --workdir /tmp/shardzoo

Presets switch the parallelism strategy with one word (rules and mesh below stay editable):
  --config configs/default.py:dp       pure data parallel       mesh data=8
  --config configs/default.py:fsdp     fully sharded data par.  mesh data=2, fsdp=4
  --config configs/default.py:tp       tensor parallel (+data)  mesh data=2, tensor=4
  --config configs/default.py:fsdp_tp  FSDP + tensor (default)  mesh data=2, fsdp=2, tensor=2
Any field can be overridden, e.g. --config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1.

Target: eval loss within 0.05 nats of the language's entropy floor (printed at start, ~1.258 nats/token
for the default language; a bigram model cannot go below ~2.54, uniform guessing is ln 16 = 2.77).
"""
import ml_collections

from configs import common

# Logical-axis rules per preset. First free match wins; later rules for a name are fallbacks; None replicates.
RULES = {
    'dp': [
        ('batch', 'data'),
        ('length', None), ('embed', None), ('mlp', None), ('heads', None), ('kv_heads', None), ('kv', None),
        ('vocab', None), ('norm', None),
    ],
    'fsdp': [
        ('batch', ('data', 'fsdp')),
        ('embed', 'fsdp'), ('embed', None),  # params sharded on embed; activations fall back to None
        ('length', None), ('mlp', None), ('heads', None), ('kv_heads', None), ('kv', None), ('vocab', None),
        ('norm', None),
    ],
    'tp': [
        ('batch', 'data'),
        ('mlp', 'tensor'), ('heads', 'tensor'), ('kv_heads', 'tensor'), ('vocab', 'tensor'),
        ('length', None), ('embed', None), ('kv', None), ('norm', None),
    ],
    'fsdp_tp': [
        ('batch', ('data', 'fsdp')),
        ('embed', 'fsdp'), ('embed', None),
        ('mlp', 'tensor'), ('heads', 'tensor'), ('kv_heads', 'tensor'), ('vocab', 'tensor'),
        ('length', None), ('kv', None), ('norm', None),
    ],
}
MESHES = {
    'dp': dict(data=8, fsdp=1, tensor=1),
    'fsdp': dict(data=2, fsdp=4, tensor=1),
    'tp': dict(data=2, fsdp=1, tensor=4),
    'fsdp_tp': dict(data=2, fsdp=2, tensor=2),
}


def get_config(preset: str = 'fsdp_tp') -> ml_collections.ConfigDict:
  if preset not in RULES:
    raise ValueError(f'unknown preset {preset!r} for configs/default.py; choose one of {sorted(RULES)}')
  c = ml_collections.ConfigDict()
  c.preset = preset
  c.seed = 0
  c.task = 'lm'
  # Mesh axis name -> size, in device-layout order (outermost first). One size may be -1.
  c.mesh = ml_collections.ConfigDict(MESHES[preset], sort_keys=False)
  c.logical_axis_rules = RULES[preset]

  c.model = ml_collections.ConfigDict(dict(
      name='gpt2', vocab_size=16, max_len=64, num_layers=4, num_heads=4, embed_dim=128, mlp_dim=512,
      norm_eps=1e-5, dtype='float32', param_dtype='float32', attention='auto'))
  c.dataset = ml_collections.ConfigDict(dict(
      name='markov', vocab_size=16, branching=4, smoothing=0.03, seed=0, seq_len=64,
      num_train=65536, num_eval=2000))

  c.batch_size = 32  # global
  c.total_steps = 1200
  c.optim = ml_collections.ConfigDict(dict(
      name='adamw', lr=3e-3, warmup_steps=100, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
      weight_decay=0.1, grad_clip=1.0))
  c.log_every = 100
  c.eval_every = 400
  c.sample_len = 48
  return common.add_run_fields(c)
