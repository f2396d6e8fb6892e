r"""Default: a small GPT-style LM on a synthetic order-2 Markov language, 8 devices (data x fsdp x tensor).

  python train.py --config configs/default.py --workdir /tmp/shardzoo

Presets switch the parallelism strategy with one word (rules and mesh below stay editable):
  --config configs/default.py:dp       pure data parallel       mesh data=8
  --config configs/default.py:fsdp     fully sharded data par.  mesh data=2, fsdp=4
  --config configs/default.py:tp       tensor parallel (+data)  mesh data=2, tensor=4
  --config configs/default.py:fsdp_tp  FSDP + tensor (default)  mesh data=2, fsdp=2, tensor=2
Any field can be overridden, e.g. --config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1.

Target: eval loss within 0.03 nats of the language's entropy floor (printed at start, ~1.258 nats/token
for the default language; a bigram model cannot go below ~2.54, uniform guessing is ln 16 = 2.77).
"""

from configs import common, schema

# The transformer presets (configs/common.py) without the 'layers' rule (this model's 4 blocks are unrolled),
# on meshes that keep a data axis in every preset. Edit them here, e.g. RULES['tp'] = [...].
RULES, _ = common.transformer_presets(drop=('layers',))
MESHES = {
  'dp': dict(data=8, fsdp=1, tensor=1),
  'fsdp': dict(data=2, fsdp=4, tensor=1),
  'tp': dict(data=2, fsdp=1, tensor=4),
  'fsdp_tp': dict(data=2, fsdp=2, tensor=2),
}


def get_config(arg: str | None = 'fsdp_tp'):
  preset, size = common.parse_arg(
    arg, RULES, ('small',), default_preset='fsdp_tp', default_size='small', file='default.py'
  )
  c = common.base(preset, size)
  c.task = 'lm'
  c.mesh = common.mesh(MESHES[preset])  # mesh axis name -> size, outermost first; one size may be -1
  c.logical_axis_rules = RULES[preset]
  # The speed and memory options of docs/model_options.md (attention, remat, ...) at their defaults.
  # vocab_size: the language's 16 symbols (left to the data: configs/schema.py)
  model = dict(name='gpt2', max_len=64, num_layers=4, num_heads=4, embed_dim=128, mlp_dim=512)
  c.model = common.ConfigDict(dict(**model, norm_eps=1e-5))
  # The Markov language of 16 symbols, branching 4, smoothing 0.03 (configs/schema.py's defaults).
  c.dataset = common.ConfigDict(dict(name='markov', seq_len=64, num_train=65536, num_eval=2000))
  c.batch_size = 32  # global
  c.total_steps = 1200
  c.optim = common.ConfigDict(dict(lr=3e-3))  # AdamW, warmup 100, cosine to 10%, b2 0.95, weight decay 0.1, clip 1
  c.log_every, c.eval_every, c.sample_len = 100, 400, 48
  return schema.complete(c)
