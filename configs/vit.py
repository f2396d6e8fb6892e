r"""ViT (Ti/16, S/16, B/16 at 224x224 on ImageNet; B/16 is 86.6M parameters): patches, class token, pre-LN blocks.

  python train.py --config configs/vit.py:tiny --workdir /tmp/vit_tiny           # seconds on CPU, offline data
  python train.py --config configs/vit.py --workdir /tmp/vit_b16 --dry_run       # per-device memory, B/16, fsdp
  python train.py --config configs/vit.py:b16 --workdir /tmp/vit_b16             # B/16 on imagenet2012 (TFDS)

Presets (one word switches the strategy; rules and meshes below stay editable):
  :dp       data parallel            mesh data=8
  :fsdp     fully sharded (default)  mesh data=1, fsdp=8
  :tp       tensor parallel + data   mesh data=2, tensor=4   heads and mlp on 'tensor' (B/16: 12 heads;
                     S/16's 6 heads: add --config.mesh.data=4 --config.mesh.tensor=2; Ti/16's 3: dp or fsdp)
Sizes: ti16 (d=192, 3 heads), s16 (d=384, 6 heads), b16 (default; d=768, 12 heads), all 12 layers on
imagenet2012 224x224 (DeiT's recipe: AdamW, lr 1e-3 at batch 1024, weight decay 0.05, 300 epochs;
no mixup/RandAugment here); tiny (2 layers, d=64, 16x16 images in 4x4 patches, offline synthetic_images).
"""

from configs import common, schema

_IMAGE = [
  ('height', None),
  ('width', None),
  ('channels', None),
  ('classes', None),
  ('layers', None),
  ('length', None),
  ('kv', None),
  ('norm', None),
]
RULES = {
  'dp': [('batch', 'data'), ('embed', None), ('mlp', None), ('heads', None), ('kv_heads', None)] + _IMAGE,
  'fsdp': [
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('embed', None),  # params sharded on embed; activations fall back to None
    ('mlp', None),
    ('heads', None),
    ('kv_heads', None),
  ]
  + _IMAGE,
  'tp': [('batch', 'data'), ('mlp', 'tensor'), ('heads', 'tensor'), ('kv_heads', 'tensor'), ('embed', None)] + _IMAGE,
}
MESHES = {
  'dp': dict(data=8, fsdp=1, tensor=1),
  'fsdp': dict(data=1, fsdp=8, tensor=1),
  'tp': dict(data=2, fsdp=1, tensor=4),
}
_IMAGENET = dict(image_size=224, patch_size=16, channels=3, num_classes=1000, num_layers=12)
SIZES = {
  'ti16': dict(**_IMAGENET, embed_dim=192, num_heads=3, mlp_dim=768),
  's16': dict(**_IMAGENET, embed_dim=384, num_heads=6, mlp_dim=1536),
  'b16': dict(**_IMAGENET, embed_dim=768, num_heads=12, mlp_dim=3072),
  'tiny': dict(
    image_size=16, patch_size=4, channels=3, num_classes=10, num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128
  ),
}


def get_config(arg: str | None = None):
  preset, size = common.parse_arg(arg, RULES, SIZES, default_preset='fsdp', default_size='b16', file='vit.py')
  c = common.base(preset, size)
  c.task = 'classification'
  c.mesh = common.mesh(MESHES[preset])
  c.logical_axis_rules = RULES[preset]
  m = SIZES[size]
  c.model = common.ConfigDict(
    dict(
      name='vit',
      **m,
      norm_eps=1e-12,
      scan_layers=True,
    )
  )
  if size == 'tiny':
    c.dataset = common.ConfigDict(
      dict(
        name='synthetic_images',
        image_size=m['image_size'],
        channels=m['channels'],
        num_classes=m['num_classes'],
        num_train=4096,
        num_eval=512,
      )
    )
    c.batch_size = 32
    c.total_steps = 300
    c.optim = common.ConfigDict(dict(lr=3e-3, weight_decay=0.0))  # warmup: a tenth of the run (configs/schema.py)
    c.eval_every = 300
  else:
    c.model.update(common.REAL_SIZE_MODEL)  # bf16 compute, unrolled layers
    c.dataset = common.ConfigDict(dict(name='imagenet2012', image_size=224, channels=3, num_classes=1000))
    c.batch_size = 1024
    c.total_steps = 300 * 1251  # 300 epochs of 1,281,167 images
    c.optim = common.ConfigDict(dict(lr=1e-3, warmup_steps=5 * 1251, b2=0.999, weight_decay=0.05))
    c.log_every, c.eval_every = 100, 5 * 1251
  return schema.complete(c)
