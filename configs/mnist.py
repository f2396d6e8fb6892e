r"""MNIST classifiers: a small CNN (default) or an MLP, 28x28x1 images, 10 classes.

  python train.py --config configs/mnist.py:tiny --workdir /tmp/mnist_tiny      # seconds on CPU, offline data
  python train.py --config configs/mnist.py --workdir /tmp/mnist                # CNN on mnist (TFDS)
  python train.py --config configs/mnist.py:mlp,tp --workdir /tmp/mnist_mlp     # MLP, tensor parallel

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp    data parallel (default)      mesh data=8
  :fsdp  fully sharded data parallel  mesh data=1, fsdp=8     every kernel sharded on one dim
  :tp    tensor parallel + data       mesh data=2, tensor=4   MLP: Megatron column/row pairs ('mlp' then
                                                              'embed'); CNN: conv outputs split by channel
Sizes (the model is part of the size): cnn (default; Flax's MNIST CNN: conv 32, conv 64, dense 256,
824K parameters), mlp (784-512-512-10, 670K), on mnist; tiny (CNN 8-16-32) and mlp_tiny (784-64-32-10)
on offline synthetic_images of the same shape.
"""

from configs import common, schema

RULES = {
  'dp': [
    ('batch', 'data'),
    ('mlp', None),
    ('embed', None),
    ('conv_in', None),
    ('conv_out', None),
    ('height', None),
    ('width', None),
    ('channels', None),
    ('classes', None),
  ],
  'fsdp': [
    ('batch', ('data', 'fsdp')),
    ('mlp', 'fsdp'),
    ('mlp', None),
    ('embed', 'fsdp'),
    ('embed', None),
    ('conv_in', 'fsdp'),
    ('conv_out', None),
    ('height', None),
    ('width', None),
    ('channels', None),
    ('classes', None),
  ],
  'tp': [
    ('batch', 'data'),
    ('mlp', 'tensor'),
    ('embed', None),
    ('conv_out', 'tensor'),
    ('conv_in', None),
    ('height', None),
    ('width', None),
    ('channels', None),
    ('classes', None),
  ],
}
MESHES = {
  'dp': dict(data=8, fsdp=1, tensor=1),
  'fsdp': dict(data=1, fsdp=8, tensor=1),
  'tp': dict(data=2, fsdp=1, tensor=4),
}
_MNIST = dict(image_size=28, channels=1, num_classes=10)
SIZES = {
  'cnn': dict(name='cnn', **_MNIST, features=(32, 64), mlp_dim=256),
  'mlp': dict(name='mlp', **_MNIST, hidden_dims=(512, 512)),
  'tiny': dict(name='cnn', **_MNIST, features=(8, 16), mlp_dim=32),
  'mlp_tiny': dict(name='mlp', **_MNIST, hidden_dims=(64, 32)),
}
UNUSED = {'cnn': ('embed',), 'mlp': ('conv_in', 'conv_out')}  # rules the other model needs (no warnings)


def get_config(arg: str | None = None):
  preset, size = common.parse_arg(arg, RULES, SIZES, default_preset='dp', default_size='cnn', file='mnist.py')
  c = common.base(preset, size)
  c.task = 'classification'
  c.mesh = common.mesh(MESHES[preset])
  m = SIZES[size]
  c.logical_axis_rules = [r for r in RULES[preset] if r[0] not in UNUSED[m['name']]]
  c.model = common.ConfigDict(m)
  c.batch_size = 128
  c.optim = common.ConfigDict(dict(lr=1e-3, warmup_steps=50, weight_decay=0.0))
  if size.endswith('tiny'):
    c.dataset = common.ConfigDict(
      dict(name='synthetic_images', **_MNIST, noise=4.0, num_train=4096, num_eval=512)
    )  # noise 4: eval accuracy ~0.98 after 200 steps, not 1.0 at once
    c.batch_size = 32
    c.total_steps = 200
    c.optim.update(lr=3e-3, warmup_steps=20)
    c.eval_every = 200
  else:
    c.dataset = common.ConfigDict(dict(name='mnist', **_MNIST))
    c.total_steps = 10 * 469  # 10 epochs of 60,000 images
    c.log_every, c.eval_every = 100, 469
  return schema.complete(c)
