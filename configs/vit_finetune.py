r"""Fine-tune pretrained ViT-B/16 (Hugging Face weights, 1000 ImageNet classes) on CIFAR-10: a new
10-class head, everything else loaded.

  python train.py --config configs/vit_finetune.py --workdir /tmp/vit_ft --config.init_from=hf/vit-base-patch16-224
  python train.py --config configs/vit_finetune.py:tiny --workdir /tmp/vit_ft_tiny     # offline, from scratch

`init_from`: a Hugging Face ViTForImageClassification directory (config.json + *.safetensors), e.g.
`hf download google/vit-base-patch16-224 --local-dir hf/vit-base-patch16-224`.
`dont_load='^head/'` leaves the classifier freshly initialised for 10 classes; any other parameter the
checkpoint does not explain is an error that lists it. CIFAR-10 images are resized to 224.
Set `--config.train_only='^head/'` to train only the new head (linear probe).
Presets and rules: as configs/vit.py (dp, fsdp (default), tp).
"""

from configs import schema, vit
from configs.vit import MESHES, RULES, SIZES  # noqa: F401  (the presets and sizes of this config)


def get_config(arg: str | None = None):
  c = vit.get_config(arg)
  if c.size == 'tiny':
    return c
  c.init_from = 'hf/vit-base-patch16-224'
  c.dont_load = '^head/'
  c.model.num_classes = 10
  c.dataset.update(name='cifar10', image_size=224, channels=3, num_classes=10)
  c.batch_size = 128
  c.total_steps = 2000
  c.optim.update(lr=3e-5, warmup_steps=100, weight_decay=0.0)
  c.checkpoint_every, c.eval_every, c.log_every = 500, 500, 50
  return schema.complete(c)
