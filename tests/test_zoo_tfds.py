"""Zoo tiny configs train through train.py on TFDS datasets (tfds.testing.mock_data: no network),
switched only by config fields, as `--config.dataset.name=...` would."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import train
from configs import llama, mnist, vit


@pytest.fixture
def mock():
  with tfds.testing.mock_data(num_examples=40):
    yield


@pytest.mark.parametrize('module,arg,dataset', [(mnist, 'dp,tiny', 'mnist'), (vit, 'tp,tiny', 'cifar10')])
def test_vision_tiny_configs_train_on_tfds(module, arg, dataset, mock, tmp_path):
  cfg = module.get_config(arg)
  cfg.dataset.name = dataset  # image_size / channels / classes already match; cifar10 32x32 is resized to 16
  cfg.update(total_steps=4, log_every=2, eval_every=4, checkpoint_every=0)
  result = train.train_and_evaluate(cfg, str(tmp_path))
  assert result['eval']['weight'] == 40  # the whole mocked test split, last batch padded and masked
  assert np.isfinite(result['train']['loss']) and int(result['state'].step) == 4


def test_llama_tiny_trains_on_packed_lm1b(mock, tmp_path):
  cfg = llama.get_config('fsdp_tp,tiny')
  cfg.dataset.update(name='lm1b', pack=True)
  cfg.dataset.vocab_size = 260
  cfg.model.vocab_size = 260  # the byte tokenizer's ids
  cfg.update(total_steps=4, log_every=2, eval_every=4, checkpoint_every=0)
  result = train.train_and_evaluate(cfg, str(tmp_path))  # rotary positions and attention restart per document
  assert np.isfinite(result['eval']['loss']) and int(result['state'].step) == 4
