"""How text becomes token ids, for training and for decoding alike: the tokenizers, and the one set of rules the
training transforms (data/text.py), generate.py, evaluate_lm.py and the end-of-run sample all call, so the ids a
prompt gets when decoding are the ids training gave the same text.

The rule: a text begins as its tokenizer begins one, and a trained document ends with the end-of-text id.
  - begin(text): a Hugging Face tokenizer's own special tokens, as `tok(text)` adds them (Llama's <s>; nothing for
    GPT-2), then the text's ids; the byte tokenizer's <|bos|>, then the bytes; Markov letters as they are.
  - document(text) = begin(text) + <eos>, every id trained on.
  - prompt/completion = begin(prompt) + ids(completion) + <eos>, the loss on ids(completion) + <eos>; the prompt of
    a decode is begin(prompt): exactly the first part of such a row.
  - chat = the tokenizer's chat template, as transformers' apply_chat_template renders it, the loss on the assistant
    turns; the chat of a decode is the template with its generation prompt: exactly a trained chat before an answer.

Tokenizers: 'byte' (UTF-8 bytes 0..255 and four special ids; a ChatML-style chat template that needs nothing
downloaded; written as a Hugging Face tokenizer by `save_pretrained`), a local Hugging Face tokenizer directory
(loaded with local_files_only=True: never a hub download at run time), and the Markov languages' letters.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from data.markov import ALPHABET
from errors import ConfigError

# The byte tokenizer's chat template, ChatML-style on its own special tokens (no new ids, so runs that predate it
# keep their vocabulary): each turn is <|bos|>role\ncontent<|eos|>, and the generation prompt opens an assistant
# turn. A chat so begins with <|bos|>, like every byte text, and an answer ends with the id decoding stops at.
BYTE_CHAT_TEMPLATE = (
  '{%- for message in messages %}'
  "{{- bos_token + message['role'] + '\\n' + message['content'] + eos_token }}"
  '{%- endfor %}'
  "{%- if add_generation_prompt %}{{- bos_token + 'assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then <|pad|> 256, <|bos|> (BERT's [CLS]) 257, <|eos|> ([SEP]) 258, <|mask|> 259."""

  vocab_size: int = 260
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  mask_id: int = 259
  num_regular: int = 256  # ids 0..num_regular-1 are ordinary tokens (MLM's random replacements)
  name: str = 'byte'
  chat_template: str = BYTE_CHAT_TEMPLATE
  SPECIALS = ('<|pad|>', '<|bos|>', '<|eos|>', '<|mask|>')  # ids 256..259, as written in the chat template's text

  @property
  def cls_id(self) -> int:
    return self.bos_id

  @property
  def sep_id(self) -> int:
    return self.eos_id

  def encode(self, text: str | bytes) -> np.ndarray:
    raw = text if isinstance(text, bytes) else str(text).encode('utf-8')
    return np.frombuffer(raw, np.uint8).astype(np.int32)

  def begin(self, text: str) -> np.ndarray:
    return np.concatenate([[self.bos_id], self.encode(text)]).astype(np.int32)

  def encode_batch(self, texts: list) -> list[np.ndarray]:
    return _each(self.encode, texts)

  def begin_batch(self, texts: list) -> list[np.ndarray]:
    return _each(self.begin, texts)

  def decode(self, ids: Any, specials: bool = False) -> str:
    out, run = [], bytearray()
    for i in (int(i) for i in np.asarray(ids).ravel()):
      if i < 256:
        run.append(i)
      elif specials and i < self.vocab_size:
        out += [run.decode('utf-8', errors='replace'), self.SPECIALS[i - 256]]
        run = bytearray()
    return ''.join(out) + run.decode('utf-8', errors='replace')

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """The chat template rendered (jinja, as transformers renders templates) and its text encoded, the special
    tokens' text as their ids (as a Hugging Face tokenizer reads them in a rendered chat)."""
    rendered = _jinja(self.chat_template).render(
      messages=messages,
      add_generation_prompt=add_generation_prompt,
      bos_token=self.SPECIALS[1],
      eos_token=self.SPECIALS[2],
    )
    ids, rest = [], rendered
    while rest:
      at = min(((rest.find(s), k) for k, s in enumerate(self.SPECIALS) if s in rest), default=None)
      if at is None:
        ids += self.encode(rest).tolist()
        break
      pos, k = at
      ids += self.encode(rest[:pos]).tolist() + [256 + k]
      rest = rest[pos + len(self.SPECIALS[k]) :]
    return ids

  def save_pretrained(self, directory: str) -> list[str]:
    """Writes this tokenizer as a Hugging Face tokenizer (the `tokenizers` library: the 256 bytes in byte order,
    then the special tokens; <|bos|> added as `tok(text)` adds it; the chat template in tokenizer_config.json), so
    AutoTokenizer, and transformers' pipelines, encode and decode as this one does. Returns the files written."""
    import tokenizers  # noqa: PLC0415 (only for an export)
    import transformers  # noqa: PLC0415
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415 (GPT-2's byte alphabet)

    chars = bytes_to_unicode()  # byte -> the printable character byte-level tokenizers write it as
    tk = tokenizers.Tokenizer(tokenizers.models.BPE({chars[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.add_special_tokens(list(self.SPECIALS))
    pad, bos, eos, mask = self.SPECIALS
    tk.post_processor = tokenizers.processors.TemplateProcessing(
      single=f'{bos} $A', pair=f'{bos} $A {bos} $B', special_tokens=[(bos, self.bos_id)]
    )
    hf = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token=pad, mask_token=mask,
      chat_template=self.chat_template, model_max_length=int(1e30),
    )  # fmt: skip
    return [os.path.basename(f) for f in hf.save_pretrained(directory)]


@dataclasses.dataclass(frozen=True)
class Letters:
  """A Markov language's symbols as letters: id i is ALPHABET[i] (what the end-of-run sample prints). No special
  ids: a Markov row has no beginning or end token, so a decode runs its max_new_tokens."""

  vocab_size: int
  name: str = 'markov letters'
  pad_id: int = 0
  bos_id: None = None
  eos_id: None = None
  chat_template: None = None

  def encode(self, text: str) -> np.ndarray:
    letters = ALPHABET[: self.vocab_size]
    bad = sorted({c for c in str(text) if c not in letters})
    if bad:
      raise ConfigError(
        f'{text!r}: the Markov language has the {self.vocab_size} letters {letters!r}; {bad} are not among them'
      )
    return np.asarray([letters.index(c) for c in str(text)], np.int32)

  begin = encode

  def encode_batch(self, texts: list) -> list[np.ndarray]:
    return _each(self.encode, texts)

  begin_batch = encode_batch

  def decode(self, ids: Any, specials: bool = False) -> str:
    return ''.join(ALPHABET[int(i)] for i in np.asarray(ids).ravel() if 0 <= int(i) < self.vocab_size)


class HFTokenizer:
  """A Hugging Face tokenizer from a local directory (tokenizer.json / vocab files + config)."""

  def __init__(self, path: str):
    try:
      import transformers  # noqa: PLC0415 (optional: only needed for this tokenizer)
    except ImportError:
      raise ConfigError(
        f'config.dataset.tokenizer={path!r} needs the transformers package '
        '(pip install transformers), or use the byte tokenizer'
      ) from None
    try:
      self.tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
      raise ConfigError(
        f'config.dataset.tokenizer={path!r}: no Hugging Face tokenizer could be loaded from '
        f'that directory ({str(e).splitlines()[0]})'
      ) from None
    t = self.tok
    self.name = path
    self.vocab_size = len(t)
    self.num_regular = self.vocab_size
    self.pad_id = t.pad_token_id if t.pad_token_id is not None else 0
    self.bos_id = t.bos_token_id if t.bos_token_id is not None else t.cls_token_id
    self.eos_id = t.eos_token_id if t.eos_token_id is not None else t.sep_token_id
    self.cls_id = t.cls_token_id if t.cls_token_id is not None else self.bos_id
    self.sep_id = t.sep_token_id if t.sep_token_id is not None else self.eos_id
    self.mask_id = t.mask_token_id
    self.chat_template = t.chat_template

  def encode(self, text: str | bytes) -> np.ndarray:
    return np.asarray(self.tok(_text(text), add_special_tokens=False)['input_ids'], np.int32)

  def begin(self, text: str | bytes) -> np.ndarray:
    return np.asarray(self.tok(_text(text))['input_ids'], np.int32)

  def encode_batch(self, texts: list) -> list[np.ndarray]:
    """encode() of each text, in one call: the fast tokenizer encodes a batch in its own threads, on every core."""
    return self._batch(texts, add_special_tokens=False)

  def begin_batch(self, texts: list) -> list[np.ndarray]:
    return self._batch(texts)

  def _batch(self, texts: list, **kwargs: Any) -> list[np.ndarray]:
    masks = dict(return_attention_mask=False, return_token_type_ids=False)  # the ids alone
    return [np.asarray(ids, np.int32) for ids in self.tok([_text(t) for t in texts], **masks, **kwargs)['input_ids']]

  def decode(self, ids: Any, specials: bool = False) -> str:
    return self.tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=not specials)

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out['input_ids'])

  def save_pretrained(self, directory: str) -> list[str]:
    return [os.path.basename(f) for f in self.tok.save_pretrained(directory)]


Tokenizer = ByteTokenizer | HFTokenizer | Letters


def _text(text: str | bytes) -> str:
  """TFDS text features are bytes: UTF-8 text, as the byte tokenizer reads them."""
  return text.decode('utf-8') if isinstance(text, bytes) else str(text)


def _each(method: Any, texts: list) -> list[np.ndarray]:
  return [method(t) for t in texts]


def tokenizer(spec: str | None, follows: str | None = None) -> ByteTokenizer | HFTokenizer:
  """'byte' (or None) or a local Hugging Face tokenizer directory; `follows`: the field the spec came from when it
  was not set itself (e.g. config.init_from), named in the error."""
  if spec in (None, 'byte'):
    return ByteTokenizer()
  if not os.path.isdir(spec):
    link = f' (it follows {follows}: set config.dataset.tokenizer to choose another)' if follows else ''
    raise ConfigError(
      f"config.dataset.tokenizer={spec!r}{link} is neither 'byte' nor a local directory with a Hugging Face "
      'tokenizer (hub names are not downloaded at run time; save_pretrained() the tokenizer to a directory first)'
    )
  return HFTokenizer(spec)


def for_dataset(dataset: Any, follows: str | None = None) -> Tokenizer:
  """What a config.dataset's ids are made with: the Markov language's letters for 'markov' (its rows are ids),
  else config.dataset.tokenizer."""
  if dataset.get('name') == 'markov':
    return Letters(dataset.vocab_size)
  return tokenizer(dataset.get('tokenizer'), follows)


# --- The rules (module docstring) ----------------------------------------------------------------------------------


def document(tok: Tokenizer, text: str) -> np.ndarray:
  """A document's ids: begin(text) <eos>, every one trained on."""
  return np.concatenate([tok.begin(text), [tok.eos_id]]).astype(np.int32)


def documents(tok: Tokenizer, texts: list) -> list[np.ndarray]:
  """document() of each text, the tokenizer called once for the batch (the same ids: tested)."""
  return [np.concatenate([ids, [tok.eos_id]]).astype(np.int32) for ids in tok.begin_batch(texts)]


def prompt(tok: Tokenizer, text: str) -> list[int]:
  """A prompt's ids, in a prompt/completion row and in a decode alike: begin(text)."""
  return [int(i) for i in tok.begin(text)]


def prompt_completion(tok: Tokenizer, prompt_text: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
  """(ids, loss): prompt(prompt_text) then the completion's ids and <eos>; loss 1 on the completion and <eos>."""
  first = prompt(tok, prompt_text)
  answer = [*tok.encode(completion).tolist(), tok.eos_id]
  loss = np.concatenate([np.zeros(len(first)), np.ones(len(answer))])
  return np.asarray(first + answer, np.int32), loss


def prompt_completions(tok: Tokenizer, prompts: list, completions: list) -> list[tuple[np.ndarray, np.ndarray]]:
  """prompt_completion() of each pair, the tokenizer called once per batch of prompts and of completions."""
  out = []
  for first, answer in zip(tok.begin_batch(prompts), tok.encode_batch(completions)):
    loss = np.concatenate([np.zeros(len(first)), np.ones(len(answer) + 1)])
    out.append((np.concatenate([first, answer, [tok.eos_id]]).astype(np.int32), loss))
  return out


def check_chat_template(tok: Tokenizer, field: str) -> None:
  if getattr(tok, 'chat_template', None) is None:
    raise ConfigError(
      f"{field} renders chats with the tokenizer's chat template, and tokenizer {tok.name!r} has none "
      '(config.dataset.tokenizer: byte, or a Hugging Face tokenizer directory whose tokenizer_config.json or '
      'chat_template.jinja holds one)'
    )


def messages_of(chat: Any) -> list[dict[str, str]]:
  """The {'role', 'content'} of each message (other keys, e.g. tool calls, are not passed to the template)."""
  return [{'role': m['role'], 'content': m['content']} for m in chat]


def chat(tok: Tokenizer, chat_messages: list[dict], where: str = 'a chat') -> tuple[np.ndarray, np.ndarray]:
  """(ids, loss) of a chat as the chat template renders it, the loss on the assistant turns: turn i's tokens are
  those that rendering the chat up to and including it adds to the chat before it rendered with the generation
  prompt (the header before an answer is not trained on; the end-of-turn token after it is). A template that does
  not render a chat's beginning as a prefix of the whole (some drop earlier turns' reasoning) is an error."""
  messages = messages_of(chat_messages)
  ids = tok.render_chat(messages)
  loss = np.zeros(len(ids))
  for i, m in enumerate(messages):
    if m['role'] != 'assistant':
      continue
    before = tok.render_chat(messages[:i], add_generation_prompt=True) if i else []
    upto = tok.render_chat(messages[: i + 1])
    if upto != ids[: len(upto)] or before != upto[: len(before)]:
      raise ConfigError(
        f'{where}: the chat template of {tok.name} does not render the chat up to turn {i} as the beginning of the '
        'whole chat, so its assistant tokens cannot be told apart'
      )
    loss[len(before) : len(upto)] = 1
  return np.asarray(ids, np.int32), loss


def chat_prompt(tok: Tokenizer, chat_messages: list[dict]) -> list[int]:
  """A chat to answer: the template with its generation prompt (a trained chat's ids before an answer)."""
  check_chat_template(tok, 'a {"messages": [...]} prompt')
  return [int(i) for i in tok.render_chat(messages_of(chat_messages), add_generation_prompt=True)]


_JINJA: dict[str, Any] = {}


def _jinja(template: str) -> Any:
  """A chat template compiled as transformers compiles them (a sandboxed jinja2 environment, blocks trimmed)."""
  if template not in _JINJA:
    from jinja2.ext import loopcontrols  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    _JINJA[template] = env.from_string(template)
  return _JINJA[template]
