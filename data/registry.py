"""The datasets `config.dataset.name` can pick, and `build(config)`, which makes one for `config.task`.

Your own files (data/files.py): 'json' (JSON Lines, also .gz), 'parquet', 'text' (config.dataset.train_files /
eval_files: globs; config.dataset.mixture: (glob, weight) pairs), or 'hf', a Hugging Face dataset
(config.dataset.path: a hub id or a save_to_disk directory; train_files / eval_files: split names). Rows are read
by text_key (lm, mlm), prompt_key + completion_key, or messages_key (lm, the loss on the answers).

Offline datasets (no files; deterministic from config.dataset.seed): 'markov', 'markov_text',
'synthetic_images'. Any other name is a TFDS dataset prepared in config.dataset.data_dir: image
datasets (features 'image' + 'label') serve 'classification', text datasets (feature `text_key`)
'lm' and 'mlm', and 'text_classification' when they have a 'label'. config.dataset fields left None take
the dataset's own (TFDS_DEFAULTS for well-known TFDS datasets).

config.dataset fields (their types and defaults: configs/schema.py FIELDS): name, data_dir, train_split,
eval_split, seq_len, image_size, channels, num_classes, tokenizer ('byte' or a local Hugging Face tokenizer
directory), pack, token_cache, augment, text_key, mlm_probability, num_threads, num_workers, prefetch, the offline
datasets' own (num_train, num_eval, seed, ...), and the files' own (train_files, eval_files, mixture, path, cache_dir,
sample_by, prompt_key, completion_key, messages_key, no_assistant).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import ml_collections

from configs import schema
from data import files, pipeline, preference, row_checks, text, tfds_source, token_cache, tokens, vision
from data.dataset import Cached, Dataset
from data.markov import MarkovLanguage, MarkovText
from data.text import lm_example
from errors import ConfigError

OFFLINE = ('markov', 'markov_text', 'synthetic_images')
TEXT_TASKS = ('lm', 'mlm', 'text_classification')
FILE_TASKS = ('lm', 'mlm')  # your own files: plain text (text_key) for both, prompt/completion pairs and chats for lm
# Defaults for well-known TFDS datasets (any field can be set in config.dataset instead).
TFDS_DEFAULTS = {
  'mnist': dict(eval_split='test', augment='none', mean=(0.1307,), std=(0.3081,)),
  'cifar10': dict(eval_split='test', augment='crop_flip', mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
  'imagenet2012': dict(
    eval_split='validation',
    augment='inception_crop',
    image_size=224,
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
  ),
  'lm1b': dict(eval_split='test'),
  'c4': dict(eval_split='validation'),
}


def _own(value: Any, own: Any) -> Any:
  """A config.dataset value, or the dataset's own where the field holds None (its schema default)."""
  return own if value is None else value


def _seq_len(cfg: ml_collections.ConfigDict, task: str) -> int:
  """LM needs one input and one target; BERT rows need [CLS] and [SEP] around at least one token."""
  L, minimum = cfg.seq_len, 2 if task == 'lm' else 3
  if not isinstance(L, int) or L < minimum:
    raise ConfigError(f'config.dataset.seq_len={L!r}: must be an integer >= {minimum}')
  return L


def _check_task(name: str, task: str, serves: tuple[str, ...]) -> None:
  if task not in serves:
    raise ConfigError(f'config.task={task!r} does not fit dataset {name!r}, which serves {list(serves)}')


def _cached(source: Any, cache: Any, what: str) -> Any:
  """`source` (a Mixture: each of its sources) as its token cache's documents (`cache(source, what)`; None: it
  has none, and is read as it is), or None where no part of it has one."""
  if isinstance(source, pipeline.Mixture):
    parts = [_cached(s, cache, f'{what}[{i}]') for i, s in enumerate(source.sources)]
    return None if None in parts else pipeline.Mixture(parts, source.weights)
  return cache(source, what)


def _token_cached(cfg, train: Any, eval_: Any, cache: Any, row: Any) -> Cached | None:
  """The sources' token caches (data/token_cache.py), read by `row` (a cached document -> what the rows'
  transform makes), where config.dataset.token_cache is on and both splits have one; else None, and the rows are
  tokenized as they are read (the reference the caches are tested against)."""
  if cache is None or not cfg.token_cache:
    return None
  cached_train = _cached(train, cache, 'train_files' if isinstance(train, files.Rows) else 'train')
  cached_eval = (
    _cached(eval_, cache, 'eval_files' if isinstance(eval_, files.Rows) else 'eval') if cached_train else None
  )
  return None if cached_eval is None else Cached(cached_train, cached_eval, row)


def _text_dataset(
  cfg,
  task: str,
  name: str,
  train: Any,
  eval_: Any,
  where: str,
  num_classes: int | None = None,
  cache: Any = None,
) -> Dataset:
  """Tokenizer, then the task's transform: packed or per-row LM documents, MLM masking, or classification.
  `cache(source, what)`: the source's token cache for LM documents (token_cache.TokenDocs), or None."""
  L = _seq_len(cfg, task)
  tok = tokens.tokenizer(cfg.tokenizer, schema.derived_from(cfg, 'tokenizer'))
  key, pack, cached = cfg.text_key, cfg.pack, None
  if pack and task != 'lm':
    raise ConfigError(f'config.dataset.pack=True packs documents for task lm, not {task!r}')
  prompt = ('--prompt', _opening(eval_[0][key])) if task == 'lm' and len(eval_) else None
  if task == 'lm':
    if tok.eos_id is None:
      raise ConfigError(f'tokenizer {tok.name!r} has no end-of-text token: LM documents need one')
    cut = None if pack else text.Truncations(L + 1)
    row = (lambda doc: doc) if pack else (lambda doc: text.LMRow(doc, L))
    transform = row(text.LMDocument(tok, key, cut))
    bound = (lambda source, what: cache(source, tok, what)) if cache else None
    cached = _token_cached(cfg, train, eval_, bound, row(text.CachedDocument(cut)))
    layout = f'packed rows of {L} tokens' if pack else f'one document per row (truncated to {L} tokens)'
  elif task == 'mlm':
    if tok.mask_id is None:
      raise ConfigError(f'tokenizer {tok.name!r} has no mask token: task mlm needs one')
    prob = cfg.mlm_probability
    transform, layout = text.MaskTokens(tok, L, prob, key), f'rows of {L} tokens, {prob:.0%} masked'
  else:
    transform, layout = text.ClassifyText(tok, L, key), f'rows of {L} tokens'
  return Dataset(
    name,
    train,
    eval_,
    transform,
    pack_len=L if pack else None,
    cached=cached,
    num_threads=cfg.num_threads,
    num_workers=cfg.num_workers,
    prefetch=cfg.prefetch,
    tokenizer=tok,
    vocab=(tok.vocab_size, f'the {tok.name} tokenizer'),
    num_classes=num_classes if task == 'text_classification' else None,
    prompt=prompt,
    description=f'{name} ({where}): train {len(train):,} / eval {len(eval_):,} documents; '
    f'{tok.name} tokenizer ({tok.vocab_size} ids); {layout}',
  )


def _image_dataset(
  cfg,
  name: str,
  train: Any,
  eval_: Any,
  where: str,
  *,
  size: int,
  channels: int,
  num_classes: int,
  augment: str,
  mean: Any,
  std: Any,
) -> Dataset:
  for key, actual in (('channels', channels), ('num_classes', num_classes)):
    if cfg[key] is not None and cfg[key] != actual:
      raise ConfigError(f'config.dataset.{key}={cfg[key]} but {name} has {actual}')
  if augment not in vision.AUGMENTATIONS:
    raise ConfigError(f'config.dataset.augment={augment!r}; choose one of {list(vision.AUGMENTATIONS)}')
  if not isinstance(size, int) or size < 1:
    raise ConfigError(f'config.dataset.image_size={size!r}: must be a positive integer')
  return Dataset(
    name,
    train,
    eval_,
    vision.TrainImages(size, augment, mean, std),
    vision.EvalImages(size, augment, mean, std),
    num_threads=cfg.num_threads,
    num_workers=cfg.num_workers,
    prefetch=cfg.prefetch,
    num_classes=num_classes,
    description=f'{name} ({where}): train {len(train):,} / eval {len(eval_):,} images, '
    f'{size}x{size}x{channels}, {num_classes} classes; train augmentation {augment}',
  )


def _offline(cfg, task: str) -> Dataset:
  name, seed = cfg.name, cfg.seed
  if name == 'markov':
    _check_task(name, task, ('lm',))
    if cfg.pack:
      raise ConfigError("config.dataset.pack=True: 'markov' rows are single sequences, there is nothing to pack")
    lang = MarkovLanguage(cfg.vocab_size, cfg.branching, cfg.smoothing, seed)
    n, letters = cfg.seq_len + 1, tokens.Letters(lang.vocab_size)
    eval_rows = lang.sample(cfg.num_eval, n, seed=seed + 2)
    return Dataset(
      name,
      lang.sample(cfg.num_train, n, seed=seed + 1),
      eval_rows,
      lm_example,
      language=lang,
      tokenizer=letters,
      prompt=('--prompt', letters.decode(eval_rows[0, :2])),  # as the end-of-run sample starts
      vocab=(lang.vocab_size, 'the markov language (config.dataset.vocab_size)'),
      description=f'markov: {cfg.num_train:,} train / {cfg.num_eval:,} eval sequences of {n} tokens',
    )
  num_train, num_eval = cfg.num_train, cfg.num_eval
  if name == 'synthetic_images':  # its own sizes where config.dataset leaves them None: 32x32x3, 10 classes
    _check_task(name, task, ('classification',))
    size, channels, num_classes = _own(cfg.image_size, 32), _own(cfg.channels, 3), _own(cfg.num_classes, 10)
    make = lambda num, split: vision.SyntheticImages(
      num, size, channels, num_classes, seed, split, cfg.noise, cfg.max_shift
    )
    return _image_dataset(
      cfg,
      name,
      make(num_train, 0),
      make(num_eval, 1),
      'offline',
      size=size,
      channels=channels,
      num_classes=num_classes,
      augment=_own(cfg.augment, 'none'),
      mean=(0.5,) * channels,
      std=(0.25,) * channels,
    )
  _check_task(name, task, TEXT_TASKS)
  L = _seq_len(cfg, task)
  # Its own lengths where config.dataset leaves them None: strings that fill a row, down to a quarter of that;
  # 2 classes (languages) where the task has none.
  max_len = _own(cfg.max_text_len, L if task == 'lm' else max(1, L - 2))
  num_classes = _own(cfg.num_classes, 2) if task == 'text_classification' else 2
  make = lambda num, split: MarkovText(
    num,
    _own(cfg.min_text_len, max(1, max_len // 4)),
    max_len,
    num_classes,
    seed,
    split,
    cfg.vocab_size,
    cfg.branching,
    cfg.smoothing,
  )
  return _text_dataset(cfg, task, name, make(num_train, 0), make(num_eval, 1), 'offline', num_classes)


def _tfds(cfg, task: str) -> Dataset:
  name = cfg.name
  b = tfds_source.builder(name, cfg.data_dir or None, OFFLINE)
  preset, features = TFDS_DEFAULTS.get(name.split('/')[0], {}), b.info.features
  splits = list(b.info.splits)
  default_eval = 'test' if not splits or 'test' in splits else 'validation'
  train_split = cfg.train_split
  eval_split = _own(cfg.eval_split, preset.get('eval_split', default_eval))
  key = cfg.text_key
  open_ = lambda: (
    tfds_source.open_split(b, name, train_split, 'train_split'),
    tfds_source.open_split(b, name, eval_split, 'eval_split'),
  )
  if 'image' in features and 'label' in features:
    _check_task(name, task, ('classification',))
    shape = features['image'].shape
    train, eval_ = open_()
    native = shape[0] if shape[0] is not None and shape[0] == shape[1] else None
    return _image_dataset(
      cfg,
      name,
      train,
      eval_,
      f'TFDS, {b.data_dir}',
      size=_own(cfg.image_size, native or preset.get('image_size', 224)),
      channels=shape[-1],
      num_classes=features['label'].num_classes,
      augment=_own(cfg.augment, preset.get('augment', 'inception_crop' if native is None else 'none')),
      mean=preset.get('mean', (0.5,) * shape[-1]),
      std=preset.get('std', (0.5,) * shape[-1]),
    )
  if key in features:
    labelled = 'label' in features
    _check_task(name, task, TEXT_TASKS if labelled else ('lm', 'mlm'))
    if task == 'text_classification' and cfg.num_classes not in (None, features['label'].num_classes):
      raise ConfigError(f'config.dataset.num_classes={cfg.num_classes} but {name} has {features["label"].num_classes}')
    ident = {'tfds': b.info.full_name, 'data_dir': str(b.data_dir)}
    ident['files'] = files.identity(sorted(glob.glob(os.path.join(str(b.data_dir), '*'))))
    cache = lambda source, tok, what: token_cache.of_source(
      source, {**ident, 'split': train_split if what == 'train' else eval_split}, tok, key, cfg.cache_dir,
      f'{name} {what}',
    )  # fmt: skip
    labels = features['label'].num_classes if labelled else None
    return _text_dataset(cfg, task, name, *open_(), f'TFDS, {b.data_dir}', labels, cache)
  raise ConfigError(
    f'TFDS dataset {name!r} has neither image+label nor a {key!r} text feature '
    f'(its features: {sorted(features)}); set config.dataset.text_key for text datasets'
  )


def _sft_keys(cfg) -> tuple[str | None, str | None, str | None]:
  """(prompt_key, completion_key, messages_key) as set; ConfigError for a half-set pair or both kinds at once."""
  prompt, completion, messages = cfg.prompt_key, cfg.completion_key, cfg.messages_key
  if bool(prompt) != bool(completion):
    raise ConfigError(
      f'config.dataset.prompt_key={prompt!r}, completion_key={completion!r}: prompt/completion pairs need both'
    )
  if prompt and messages:
    raise ConfigError('config.dataset sets both prompt_key/completion_key and messages_key: rows are one or the other')
  return prompt or None, completion or None, messages or None


def _opening(text: Any, words: int = 4) -> str:
  """The first words of a document: a prompt to continue."""
  return ' '.join(str(text).split()[:words])


def _sft_prompt(row: dict, prompt: str | None, messages: str | None) -> tuple[str, str]:
  """generate.py's flag and text for a held-out row: its prompt, or its chat's first user turn (--chat)."""
  if prompt:
    return '--prompt', str(row[prompt])
  first = next((m['content'] for m in row[messages] if m['role'] == 'user'), row[messages][0]['content'])
  return '--chat', str(first)


def _files(cfg, task: str) -> Dataset:
  """JSON Lines / parquet / text files or a Hugging Face dataset (data/files.py): plain text by `text_key` for
  'lm' and 'mlm'; prompt/completion pairs or chats for 'lm' with the loss on the answers (SFT)."""
  name = cfg.name
  _check_task(name, task, FILE_TASKS)
  prompt, completion, messages = _sft_keys(cfg)
  keys = [prompt, completion] if prompt else [messages] if messages else [cfg.text_key]
  mixture = cfg.mixture
  if mixture and cfg.train_files:
    raise ConfigError('config.dataset.mixture replaces config.dataset.train_files: set one of them')
  # 'hf': train_files names a split of config.dataset.path, 'train' where unset
  train_spec, eval_spec = cfg.train_files or ('train' if name == 'hf' else None), cfg.eval_files
  if not mixture and not train_spec:
    raise ConfigError(f'config.dataset.name={name!r} needs config.dataset.train_files (a glob) or .mixture')
  if not eval_spec:
    raise ConfigError(
      f'config.dataset.name={name!r} needs config.dataset.eval_files: a glob of held-out files'
      + (' (a split of config.dataset.path)' if name == 'hf' else '')
    )
  skipped, sources = {}, {}

  def rows(spec: str, what: str) -> files.Rows:
    r = files.open_rows(cfg, spec, what, keys)
    if prompt or messages:
      row_checks.check_types(r, [prompt, completion] if prompt else [], messages)
    if messages:
      r, skipped[what] = files.with_assistant(r, messages, cfg.no_assistant)
    sources[what] = r
    return r

  if mixture:
    parts = [rows(spec, f'mixture[{i}]') for i, (spec, _) in enumerate(mixture)]
    train = pipeline.Mixture(parts, [w for _, w in mixture])
    where = 'mixture ' + ', '.join(f'{spec} x{w:g}' for spec, w in mixture)
  else:
    train, where = rows(train_spec, 'train_files'), f'{train_spec}; eval {eval_spec}'
  eval_ = rows(eval_spec, 'eval_files')
  if name == 'hf':
    where = f'{cfg.path}: {where}'
  where += ''.join(f'; {n:,} chats without an assistant turn left out of {w}' for w, n in skipped.items() if n)
  if not (prompt or messages):
    cache = lambda source, tok, what: token_cache.of_rows(source, tok, 'text', keys, cfg.cache_dir, what)
    return _text_dataset(cfg, task, name, train, eval_, where, cache=cache)
  _check_task(name, task, ('lm',))
  L = _seq_len(cfg, task)
  tok = tokens.tokenizer(cfg.tokenizer, schema.derived_from(cfg, 'tokenizer'))
  if tok.eos_id is None:
    raise ConfigError(f'tokenizer {tok.name!r} has no end-of-text token: LM documents need one')
  if messages:
    tokens.check_chat_template(tok, f'config.dataset.messages_key={messages!r}')
  for what, r in sources.items():  # answers that seq_len cuts away entirely: counted before training starts
    row_checks.check_sft(r, what, tok, L, prompt, completion, messages)
  cut = text.Truncations(L + 1)
  doc = text.ChatDocument(tok, messages, cut) if messages else text.PromptCompletion(tok, prompt, completion, cut)
  kind = 'chat' if messages else 'pair'
  cache = lambda source, what: token_cache.of_rows(source, tok, kind, keys, cfg.cache_dir, what)
  pack = cfg.pack
  cached = _token_cached(
    cfg, train, eval_, cache, text.CachedDocument(cut) if pack else text.LMRow(text.CachedDocument(cut), L)
  )
  kind = 'chats (loss on the assistant turns)' if messages else 'prompt/completion pairs (loss on the completions)'
  layout = f'whole documents packed into rows of {L} tokens' if pack else f'one document per row of {L} tokens'
  return Dataset(
    name,
    train,
    eval_,
    doc if pack else text.LMRow(doc, L),
    pack_len=L if pack else None,
    pack_whole=True,
    cached=cached,
    num_threads=cfg.num_threads,
    num_workers=cfg.num_workers,
    prefetch=cfg.prefetch,
    tokenizer=tok,
    vocab=(tok.vocab_size, f'the {tok.name} tokenizer'),
    prompt=_sft_prompt(eval_[0], prompt, messages),
    description=f'{name} ({where}): train {len(train):,} / eval {len(eval_):,} {kind}; {tok.name} tokenizer '
    f'({tok.vocab_size} ids); {layout}; longer ones truncated (counted in the log)',
  )


def vocabulary(config: ml_collections.ConfigDict) -> str | None:
  """config.model.vocab_size where it is None (the language models' tiny sizes leave it to the data: configs/schema.py)
  set to the data's, its tokenizer's ids; the line that says so, or None where it was set."""
  if 'vocab_size' not in config.model or config.model.vocab_size is not None:
    return None
  tok = tokens.for_dataset(config.dataset, schema.derived_from(config.dataset, 'tokenizer'))
  config.model.vocab_size = tok.vocab_size
  return f"config.model.vocab_size={tok.vocab_size}: the {tok.name} tokenizer's ids"


def build(config: ml_collections.ConfigDict) -> Dataset:
  """The dataset of `config.dataset` for `config.task` (the whole config; `config.model` is not read:
  the task checks the dataset against the model, training.tasks.Task.check_data).

  Raises ConfigError, before any example is read, for an unknown dataset, split, task or a bad size;
  an unprepared TFDS dataset fails at once with the command that prepares it.
  """
  cfg, task = config.dataset, config.task
  if task == 'dpo':
    ds = preference.pairs(cfg)
  elif task == 'grpo':
    ds = preference.prompts(cfg, config.grpo.max_new_tokens)
  elif cfg.name in files.NAMES:
    ds = _files(cfg, task)
  else:
    ds = _offline(cfg, task) if cfg.name in OFFLINE else _tfds(cfg, task)
  if not len(ds.eval):
    raise ConfigError(f'the eval split of {cfg.name!r} is empty')
  return ds
