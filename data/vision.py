"""Per-example image transforms (numpy + PIL) for the 'classification' task, and an offline image dataset.

Train augmentations (grain RandomMaps, so each example's randomness is a function of the seed and
its index in the stream): 'inception_crop' (random-resized crop, area 8-100%, aspect 3/4-4/3,
then a horizontal flip: ImageNet), 'crop_flip' (pad 4, random crop, flip: CIFAR), 'none'.
Eval: 'inception_crop' datasets are resized (shorter side to size/0.875) and center-cropped; the
others are only resized to `image_size` if they differ. Then pixels are normalised per channel.
"""

from __future__ import annotations

import math
from typing import Any

import grain
import numpy as np
from PIL import Image

from configs import schema

AUGMENTATIONS = ('inception_crop', 'crop_flip', 'none')
schema.register('dataset.augment', AUGMENTATIONS)
CROP_PADDING = 0.875  # eval: the center crop covers 87.5% of the resized image (the usual ImageNet protocol)


def resize(image: np.ndarray, h: int, w: int) -> np.ndarray:
  """Bilinear (antialiased) resize of a uint8 (H, W, C) image."""
  if image.shape[:2] == (h, w):
    return image
  C = image.shape[-1]
  out = np.asarray(Image.fromarray(image[..., 0] if C == 1 else image).resize((w, h), Image.BILINEAR))
  return out.reshape(h, w, C)


def inception_crop(
  image: np.ndarray,
  rng: np.random.Generator,
  size: int,
  area: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
  """A random crop of `area` of the image with aspect ratio in `ratio`, resized to size x size
  (10 tries, then the largest center crop within `ratio`)."""
  H, W = image.shape[:2]
  for _ in range(10):
    a = rng.uniform(*area) * H * W
    r = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
    w, h = int(round(math.sqrt(a * r))), int(round(math.sqrt(a / r)))
    if 0 < w <= W and 0 < h <= H:
      top, left = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
      return resize(image[top : top + h, left : left + w], size, size)
  r = min(max(W / H, ratio[0]), ratio[1])
  w, h = (W, int(round(W / r))) if W / H < r else (int(round(H * r)), H)
  w, h = min(w, W), min(h, H)
  top, left = (H - h) // 2, (W - w) // 2
  return resize(image[top : top + h, left : left + w], size, size)


def center_crop(image: np.ndarray, size: int) -> np.ndarray:
  """Resize the shorter side to size / 0.875, then crop the central size x size."""
  H, W = image.shape[:2]
  s = size / CROP_PADDING / min(H, W)
  h, w = max(size, int(round(H * s))), max(size, int(round(W * s)))
  image = resize(image, h, w)
  top, left = (h - size) // 2, (w - size) // 2
  return image[top : top + size, left : left + size]


def crop_flip(image: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
  """Zero-pad by `pad`, take a random crop of the original size, flip half of the time."""
  H, W = image.shape[:2]
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
  top, left = int(rng.integers(0, 2 * pad + 1)), int(rng.integers(0, 2 * pad + 1))
  return flip(padded[top : top + H, left : left + W], rng)


def flip(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  return image[:, ::-1] if rng.random() < 0.5 else image


class _Images:
  def __init__(self, size: int, augment: str, mean: Any, std: Any):
    self.size, self.augment = size, augment
    # (x / 255 - mean) / std as a multiply-add over whole image rows (a broadcast over the last,
    # 1-3 wide axis is ~50x slower in numpy).
    std, mean = np.asarray(std, np.float64), np.asarray(mean, np.float64)
    self.scale = np.tile(1 / (255 * std), size).astype(np.float32)
    self.offset = np.tile(-mean / std, size).astype(np.float32)

  def example(self, image: np.ndarray, label: Any) -> dict[str, np.ndarray]:
    rows = image.astype(np.float32).reshape(self.size, -1)
    rows *= self.scale
    rows += self.offset
    return {'image': rows.reshape(image.shape), 'label': np.int32(label), 'mask': np.float32(1.0)}


class TrainImages(_Images, grain.transforms.RandomMap):
  """{'image': uint8 (H, W, C), 'label'} -> augmented, normalised float32 image, label, mask 1."""

  def random_map(self, ex: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    image = np.asarray(ex['image'])
    if self.augment == 'inception_crop':
      image = flip(inception_crop(image, rng, self.size), rng)
    else:
      image = resize(image, self.size, self.size)
      if self.augment == 'crop_flip':
        image = crop_flip(image, rng)
    return self.example(image, ex['label'])


class EvalImages(_Images, grain.transforms.Map):
  """Deterministic: center crop ('inception_crop' datasets) or resize, then normalise."""

  def map(self, ex: Any) -> dict[str, np.ndarray]:
    image = np.asarray(ex['image'])
    image = center_crop(image, self.size) if self.augment == 'inception_crop' else resize(image, self.size, self.size)
    return self.example(image, ex['label'])


class SyntheticImages:
  """Offline image classification with learnable signal: each class has a smooth random pattern;
  an example is its class's pattern, cyclically shifted by up to `max_shift` pixels, plus Gaussian
  noise (`noise` times the pattern's scale), as uint8. Random access, deterministic in (seed, split, index)."""

  def __init__(
    self,
    num: int,
    image_size: int,
    channels: int,
    num_classes: int,
    seed: int,
    split: int,
    noise: float = 1.0,
    max_shift: int = 2,
  ):
    self.num, self.size, self.noise, self.max_shift = num, image_size, noise, max_shift
    self.num_classes, self.seed, self.split = num_classes, seed, split
    rng = np.random.default_rng(seed)  # the patterns are shared by every split
    coarse = rng.normal(size=(num_classes, 4, 4, channels))
    up = -(-image_size // 4)
    self.patterns = np.repeat(np.repeat(coarse, up, 1), up, 2)[:, :image_size, :image_size]

  def __len__(self) -> int:
    return self.num

  def __getitem__(self, i: int) -> dict[str, Any]:
    rng = np.random.default_rng((self.seed, self.split, int(i)))
    label = int(rng.integers(self.num_classes))
    shift = rng.integers(-self.max_shift, self.max_shift + 1, size=2)
    x = np.roll(self.patterns[label], tuple(shift), axis=(0, 1)) + self.noise * rng.normal(size=self.patterns.shape[1:])
    return {'image': np.clip(127.5 + 40 * x, 0, 255).astype(np.uint8), 'label': label}
