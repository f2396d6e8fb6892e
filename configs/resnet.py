r"""ResNet-18 / ResNet-50 (11.7M / 25.6M parameters) on ImageNet 224x224, with BatchNorm over the global batch.

  python train.py --config configs/resnet.py:tiny --workdir /tmp/resnet_tiny          # seconds on CPU, offline
  python train.py --config configs/resnet.py --workdir /tmp/resnet50 --dry_run        # per-device memory
  python train.py --config configs/resnet.py:resnet50 --workdir /tmp/resnet50         # imagenet2012 (TFDS)

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp    data parallel (default)      mesh data=8             the usual way to train a ResNet
  :fsdp  fully sharded data parallel  mesh data=1, fsdp=8     conv kernels sharded on their input channels
  :tp    channel (tensor) parallel    mesh data=2, tensor=4   conv outputs and activations split by channel
                                                              (shows the rules at work; heavy on collectives)
BatchNorm statistics are over the global batch under every preset (XLA all-reduces them); the running
mean/var are model state, named 'norm' and placed by the rules like any parameter.
Sizes: resnet50 (default; bottleneck blocks 3-4-6-3), resnet18 (basic blocks 2-2-2-2), both on
imagenet2012 with SGD + momentum 0.9, lr 0.4 at batch 1024 (0.1 per 256), 90 epochs, cosine decay
(no weight decay: training/optim.py's 'sgd' has none); tiny (basic blocks 1-2-3-1 at width 8, on 32x32
offline synthetic_images).
"""

from configs import common, schema

_REST = [('height', None), ('width', None), ('channels', None), ('classes', None), ('layers', None), ('norm', None)]
RULES = {
  'dp': [('batch', 'data'), ('conv_in', None), ('conv_out', None)] + _REST,
  'fsdp': [('batch', ('data', 'fsdp')), ('conv_in', 'fsdp'), ('conv_in', None), ('conv_out', None)] + _REST,
  'tp': [('batch', 'data'), ('conv_out', 'tensor'), ('conv_in', None)] + _REST,
}
MESHES = {
  'dp': dict(data=8, fsdp=1, tensor=1),
  'fsdp': dict(data=1, fsdp=8, tensor=1),
  'tp': dict(data=2, fsdp=1, tensor=4),
}
_IMAGENET = dict(image_size=224, channels=3, num_classes=1000, width=64)
SIZES = {
  'resnet18': dict(**_IMAGENET, block='basic', stage_sizes=(2, 2, 2, 2)),
  'resnet50': dict(**_IMAGENET, block='bottleneck', stage_sizes=(3, 4, 6, 3)),
  'tiny': dict(image_size=32, channels=3, num_classes=10, width=8, block='basic', stage_sizes=(1, 2, 3, 1)),
}


def get_config(arg: str | None = None):
  preset, size = common.parse_arg(arg, RULES, SIZES, default_preset='dp', default_size='resnet50', file='resnet.py')
  c = common.base(preset, size)
  c.task = 'classification'
  c.mesh = common.mesh(MESHES[preset])
  c.logical_axis_rules = RULES[preset]
  m = SIZES[size]
  c.model = common.ConfigDict(
    dict(
      name='resnet',
      **m,
      bn_momentum=0.9,
      bn_eps=1e-5,
      bn_fused=True,
      scan_layers=True,
    )
  )  # a bottleneck strides on its 3x3 conv (v1.5; config.model.stride_in_1x1=True: on its first 1x1, v1)
  c.optim = common.ConfigDict(dict(name='sgd', lr=0.1, min_lr_ratio=0.0, grad_clip=0.0))  # momentum 0.9
  if size == 'tiny':
    c.dataset = common.ConfigDict(
      dict(
        name='synthetic_images',
        image_size=m['image_size'],
        channels=m['channels'],
        num_classes=m['num_classes'],
        noise=4.0,
        num_train=4096,
        num_eval=512,
      )
    )  # noise 4: a learning curve, not 1.0 at once
    c.batch_size = 32
    c.total_steps = 300
    c.optim.update(lr=0.05, warmup_steps=30)
    c.eval_every = 300
  else:
    c.model.update(common.REAL_SIZE_MODEL)  # bf16 compute (f32 params, BatchNorm statistics), unrolled stages
    # One-pass BatchNorm variance (E[x^2] - mean^2 in f32): one read of each activation fewer; conv outputs
    # have |mean| of the order of their std, far from where it cancels.
    c.model.bn_fast_variance = True
    c.dataset = common.ConfigDict(dict(name='imagenet2012', image_size=224, channels=3, num_classes=1000))
    c.batch_size = 1024
    c.total_steps = 90 * 1251  # 90 epochs of 1,281,167 images
    c.optim.update(lr=0.4, warmup_steps=5 * 1251)
    c.log_every, c.eval_every = 100, 5 * 1251
  return schema.complete(c)
