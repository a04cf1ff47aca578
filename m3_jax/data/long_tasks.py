"""Synthetic long-context tasks (RULER-style) with real text as the haystack: for held-out evaluation at chosen
lengths and needle depths, and as training rows mixed into the text pipeline (loss on the answer only).

    hay = Haystack.from_corpus(data_dir, tokenizer=tok, split="heldout")
    ex = make_example("multi_key", haystack=hay, tokenizer=tok, length=4096, depth=0.5, seed=3)
    ex.prompt       # int32 [4096]: intro + haystack with the needles + question
    ex.answer       # int32 [A]: what a correct model continues with (then <|endoftext|> or a newline)

Tasks (`TASKS`); each needle is one sentence inserted between two haystack sentences:

    passkey       one pass key (a 5-digit number) in the text; "What is the pass key?"
    single_key    one key -> 7-digit number needle
    multi_key     the same, among `DISTRACTORS` needles of other keys with other numbers
    multi_value   one key with `VALUES` numbers in separate needles; answer: all of them in the order they appear
    kv            random 8-hex-digit identifiers as keys and values, the asked pair among distractor pairs
    vt            variable tracking: a chain "VAR A = 12345", "VAR B = A", ... (`HOPS` hops, each later in the
                  text) and a distractor chain; answer: the chain's variables in order

Facts every example keeps (the tests check them):
- `length` is exact: the prompt has exactly `length` tokens. Training rows are exactly `length` tokens too, and
  reserve each question a fixed room for its answer and <|endoftext|> (`answer_room`), <|endoftext|> padding
  filling what the drawn answer leaves: so where a question ends does not tell how many tokens its answer has.
- Each of `answer_anchors` (the values, or "VAR X =" for variable tracking) occurs exactly once in the decoded
  prompt; a draw whose value happens to occur in the haystack is redrawn, so a copy elsewhere cannot answer.
- Depth granularity: the answer needle (the first one for multi_value / vt) goes to the sentence boundary nearest
  to `depth * H` haystack tokens (H: the haystack tokens of the prompt); haystack sentences are cut to at most
  `max_sentence_tokens` (default 64) tokens, so `|haystack_before - depth * H| <= max_sentence_tokens / 2`.
- The same (task, length, depth, seed, haystack, tokenizer) gives the same example.

The haystack is real text from a prepared corpus: documents decoded with the corpus tokenizer, split into
sentences and encoded by the tokenizer of the model under test (so an HF checkpoint with its own vocabulary reads
the same text). A tokenizer here is anything with `encode_batch(texts, allow_special=False) -> list[list[int]]`,
`decode(ids) -> str` and `eot_id`.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from m3_jax.core.batch import EOT
from m3_jax.data.common import seed32
from m3_jax.data.text_prepare import load_manifest, load_tokenizer

__all__ = ["TASKS", "Example", "Haystack", "TaskRows", "answer_room", "make_example", "make_training_row",
           "min_length", "mix_task_rows", "parse_tasks"]

TASKS: tuple[str, ...] = ("passkey", "single_key", "multi_key", "multi_value", "kv", "vt")
DISTRACTORS = 3  # multi_key and kv: needles of other keys
VALUES = 4  # multi_value: numbers of the asked key
HOPS = 3  # vt: assignments after the first one of each chain (HOPS + 1 variables)
# The fewest haystack tokens a prompt may have; below this a "long-context" task is no longer one.
MIN_HAYSTACK = 32

_ADJ = ("amber", "bold", "brisk", "calm", "clever", "copper", "crimson", "dusty", "eager", "faint", "gentle",
        "golden", "hollow", "hidden", "ivory", "jolly", "lucky", "misty", "narrow", "noble", "olive", "pale",
        "proud", "quiet", "rapid", "rusty", "silent", "silver", "sleepy", "steady", "swift", "tender", "velvet",
        "wild", "windy", "young")
_NOUN = ("anchor", "badger", "beacon", "bridge", "canyon", "cedar", "comet", "falcon", "fern", "garden",
         "harbor", "island", "kettle", "lantern", "maple", "meadow", "mirror", "orchard", "otter", "pebble",
         "pillar", "raven", "river", "saddle", "signal", "spindle", "thistle", "tower", "valley", "willow")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

_INTRO = {
    "passkey": "A pass key is hidden in the text below. Find it and remember it.\n",
    "single_key": "Special numbers are hidden in the text below, each tied to a key. Remember them.\n",
    "multi_key": "Special numbers are hidden in the text below, each tied to a key. Remember them.\n",
    "multi_value": "Special numbers are hidden in the text below, each tied to a key. Remember them.\n",
    "kv": "Key and value identifiers are hidden in the text below. Remember them.\n",
    "vt": "Variable assignments are hidden in the text below. Follow them.\n",
}
# Sentence ends: after . ! ? (and closing quotes/brackets) before whitespace, or after a newline. The whitespace
# goes to the next sentence, so concatenating the sentences gives the text back.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)|\n")


def parse_tasks(spec: str | Sequence[str]) -> list[str]:
  """"passkey,kv" (or a list) -> task names; "" or "all" -> every task. An unknown name is a ValueError."""
  names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
  names = [n for n in names if n]
  if not names or names == ["all"]:
    return list(TASKS)
  unknown = [n for n in names if n not in TASKS]
  if unknown:
    raise ValueError(f"unknown task(s) {unknown}; the tasks are {list(TASKS)}")
  return names


# ---------------------------------------------------------------------------------------------------------------
# Haystack
# ---------------------------------------------------------------------------------------------------------------


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
  return tokenizer.encode_batch(list(texts), allow_special=False)


@dataclasses.dataclass(frozen=True)
class Haystack:
  """Real text cut into sentences, encoded: `tokens` int32 [N], sentence i is tokens[starts[i]:starts[i+1]]
  (int64 [S + 1], starts[-1] == N); no sentence is longer than `max_sentence_tokens`."""
  tokens: np.ndarray
  starts: np.ndarray
  max_sentence_tokens: int

  @property
  def num_sentences(self) -> int:
    return int(self.starts.size - 1)

  @classmethod
  def from_texts(cls, texts: Sequence[str], tokenizer: Any, *, max_sentence_tokens: int = 64) -> "Haystack":
    """Documents (str) in order; a blank line separates consecutive documents."""
    if max_sentence_tokens < 1:
      raise ValueError(f"max_sentence_tokens={max_sentence_tokens}: expected >= 1")
    pieces: list[str] = []
    for d, text in enumerate(texts):
      ends = [m.end() for m in _SENTENCE_END.finditer(text)]
      bounds = [0] + [e for e in ends if 0 < e < len(text)] + [len(text)]
      sents = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
      if d and sents:
        sents[0] = "\n\n" + sents[0]
      pieces += sents
    lengths, chunks = [], []
    for ids in _encode(tokenizer, pieces):
      for i in range(0, len(ids), max_sentence_tokens):  # overlong sentences are cut into pieces
        chunks.append(ids[i:i + max_sentence_tokens])
        lengths.append(len(chunks[-1]))
    if not chunks:
      raise ValueError("haystack: the texts are empty")
    starts = np.zeros((len(lengths) + 1,), np.int64)
    np.cumsum(lengths, out=starts[1:])
    tokens = np.fromiter((t for c in chunks for t in c), np.int32, count=int(starts[-1]))
    return cls(tokens=tokens, starts=starts, max_sentence_tokens=int(max_sentence_tokens))

  @classmethod
  def from_corpus(cls, data_dir: str, *, tokenizer: Any = None, split: str = "heldout",
                  sources: Sequence[str] | None = None, max_chars: int | None = None,
                  max_sentence_tokens: int = 64) -> "Haystack":
    """The documents of `split` of a prepared corpus (all sources, or `sources`, one document of each in turn) up
    to about `max_chars` characters, encoded by `tokenizer` (default: the corpus tokenizer)."""
    manifest = load_manifest(data_dir)
    corpus_tok = load_tokenizer(data_dir)
    names = list(sources) if sources else manifest.source_names
    unknown = [s for s in names if s not in manifest.sources]
    if unknown:
      raise ValueError(f"haystack sources {unknown} are not in {data_dir} (it has {manifest.source_names})")
    # Round-robin over the sources, so that a `max_chars` cut keeps every source in the haystack.
    streams = [manifest.documents(s, split) for s in names]
    texts, chars = [], 0
    while streams and (max_chars is None or chars < max_chars):
      for it in list(streams):
        doc = next(it, None)
        if doc is None:
          streams.remove(it)
          continue
        texts.append(corpus_tok.decode(doc[doc != EOT]))
        chars += len(texts[-1])
    if not texts:
      raise ValueError(f"no {split} documents in {data_dir} to build a haystack from")
    return cls.from_texts(texts, tokenizer or corpus_tok, max_sentence_tokens=max_sentence_tokens)

  def window(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` consecutive haystack tokens from a random sentence on (wrapping around), and the sentence boundaries
    inside them: (int32 [n], int64 [K] offsets in [0, n], 0 and n included)."""
    s = int(rng.integers(self.num_sentences))
    out, bounds, filled = [], [0], 0
    while filled < n:
      a, b = int(self.starts[s]), int(self.starts[s + 1])
      take = min(b - a, n - filled)
      out.append(self.tokens[a:a + take])
      filled += take
      bounds.append(filled)
      s = (s + 1) % self.num_sentences
    return (np.concatenate(out) if out else np.zeros((0,), np.int32)), np.unique(np.asarray(bounds, np.int64))


# ---------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance. `prompt` int32 [length] (intro, haystack with needles, question; row=True:
  [length - answer_room - 1]); `answer` int32 [A]."""
  task: str
  seed: int
  length: int
  depth: float  # requested depth of the answer needle in the haystack, in [0, 1]
  prompt: np.ndarray
  answer: np.ndarray
  answer_text: str  # the answer as text, without its leading space
  answer_anchors: tuple[str, ...]  # strings the prompt holds exactly once (see the module docstring)
  needle_pos: int  # prompt index of the answer needle's first token
  haystack_before: int  # haystack tokens before the answer needle
  haystack_tokens: int  # H: haystack tokens in the prompt


@dataclasses.dataclass(frozen=True)
class _Draw:
  """A task's random content: needles in placement order (the answer needle first), the question and answer."""
  needles: list[str]
  after_first: list[bool]  # needle i must come after needle 0 (chains)
  question: str
  answer_items: list[str]  # in the order the needles of `answer_needles` appear in the text
  answer_needles: list[int]  # needles holding an answer item; their text order gives the answer order
  anchors: list[str]
  sep: str  # between answer items
  keys: list[str]  # what the needles are about (keys, ids, variables): distinct across a row's draws


def _number(rng: np.random.Generator, digits: int) -> str:
  return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _key(rng: np.random.Generator) -> str:
  return f"{_ADJ[rng.integers(len(_ADJ))]}-{_NOUN[rng.integers(len(_NOUN))]}"


def _hex(rng: np.random.Generator) -> str:
  return "".join("0123456789abcdef"[i] for i in rng.integers(16, size=8))


def _distinct(rng: np.random.Generator, fn, n: int) -> list[str]:
  out: list[str] = []
  while len(out) < n:
    v = fn(rng)
    if v not in out:
      out.append(v)
  return out


def _draw(task: str, rng: np.random.Generator) -> _Draw:
  if task == "passkey":
    v = _number(rng, 5)
    return _Draw([f" The pass key is {v}. Remember it."], [False], "\nWhat is the pass key? The pass key is",
                 [v], [0], [v], ", ", ["pass key"])
  if task in ("single_key", "multi_key"):
    n = 1 if task == "single_key" else 1 + DISTRACTORS
    keys, vals = _distinct(rng, _key, n), _distinct(rng, lambda r: _number(r, 7), n)
    needles = [f" The special number for {k} is {v}." for k, v in zip(keys, vals)]
    return _Draw(needles, [False] * n, f"\nWhat is the special number for {keys[0]}? The special number for "
                 f"{keys[0]} is", [vals[0]], [0], vals, ", ", keys)
  if task == "multi_value":
    k, vals = _key(rng), _distinct(rng, lambda r: _number(r, 7), VALUES)
    needles = [f" One of the special numbers for {k} is {v}." for v in vals]
    return _Draw(needles, [False] * VALUES, f"\nWhat are all the special numbers for {k}? The special numbers "
                 f"for {k} are", vals, list(range(VALUES)), vals, ", ", [k])
  if task == "kv":
    n = 1 + DISTRACTORS
    ids = _distinct(rng, _hex, 2 * n)
    keys, vals = ids[:n], ids[n:]
    needles = [f" The value of key {k} is {v}." for k, v in zip(keys, vals)]
    return _Draw(needles, [False] * n, f"\nWhat is the value of key {keys[0]}? The value of key {keys[0]} is",
                 [vals[0]], [0], vals, ", ", keys)
  if task == "vt":
    names = _distinct(rng, lambda r: "".join(_LETTERS[i] for i in r.integers(26, size=5)), 2 * (HOPS + 1))
    v, w = _distinct(rng, lambda r: _number(r, 5), 2)
    chain, other = names[:HOPS + 1], names[HOPS + 1:]
    needles = [f" VAR {chain[0]} = {v}."] + [f" VAR {b} = {a}." for a, b in zip(chain[:-1], chain[1:])]
    needles += [f" VAR {other[0]} = {w}."] + [f" VAR {b} = {a}." for a, b in zip(other[:-1], other[1:])]
    after = [False] + [True] * HOPS + [False] * (HOPS + 1)
    return _Draw(needles, after, f"\nWhich variables are assigned the value {v}? The variables assigned the "
                 f"value {v} are", chain, list(range(HOPS + 1)), [f"VAR {x} =" for x in names], ", ",
                 names + [v, w])
  raise ValueError(f"unknown task {task!r}; the tasks are {list(TASKS)}")


# Every character an answer can hold: digits, hex digits, variable letters and the ", " between items.
_ANSWER_ALPHABET = " ,0123456789abcdef" + _LETTERS


def answer_room(task: str, tokenizer: Any) -> int:
  """The most tokens an answer of `task` (with its leading space) can take: its characters times the most tokens
  this tokenizer gives one character of `_ANSWER_ALPHABET` (1 for a byte-level BPE).

  A bound, not a sample maximum, so no drawn answer is ever redrawn for being long (training would then never see
  the answers eval asks for). It holds for any tokenizer that encodes a string in at most the tokens its characters
  take one by one (BPE merges only join pieces); every task's answer has a fixed number of characters (items of
  fixed width: `_number` draws exactly `digits` digits)."""
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; the tasks are {list(TASKS)}")
  d = _draw(task, np.random.default_rng(0))
  per_char = max(len(x) for x in _encode(tokenizer, list(_ANSWER_ALPHABET)))
  return len(" " + d.sep.join(d.answer_items)) * per_char


def _check_room(task: str, answer: np.ndarray, room: int) -> None:
  if len(answer) > room:
    raise RuntimeError(f"task {task!r}: the answer takes {len(answer)} tokens, more than answer_room = {room}; "
                       "this tokenizer encodes a string in more tokens than its characters take one by one")


def min_length(task: str, tokenizer: Any, *, row: bool = False) -> int:
  """The shortest `length` `make_example` accepts for `task`: intro, question and needles as this tokenizer encodes
  a sample draw, a slack of 25% for other draws, plus MIN_HAYSTACK haystack tokens; row=True (a training row)
  adds the answer's room and its <|endoftext|>."""
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; the tasks are {list(TASKS)}")
  d = _draw(task, np.random.default_rng(0))
  fixed = sum(len(x) for x in _encode(tokenizer, [_INTRO[task], d.question, *d.needles]))
  return int(fixed * 1.25) + MIN_HAYSTACK + (answer_room(task, tokenizer) + 1 if row else 0)


def _insert(hay: np.ndarray, bounds: np.ndarray, needles: list[np.ndarray], at: list[int]) -> tuple[np.ndarray,
                                                                                                     list[int]]:
  """Haystack tokens with needle i inserted at haystack offset at[i] (ties keep the needles' order); returns the
  body and each needle's start in it."""
  order = sorted(range(len(needles)), key=lambda i: (at[i], i))
  parts, starts, prev, pos = [], [0] * len(needles), 0, 0
  for i in order:
    parts.append(hay[prev:at[i]])
    pos += at[i] - prev
    starts[i] = pos
    parts.append(needles[i])
    pos += len(needles[i])
    prev = at[i]
  parts.append(hay[prev:])
  return np.concatenate(parts).astype(np.int32), starts


def _place(d: _Draw, bounds: np.ndarray, first: int, rng: np.random.Generator) -> list[int]:
  """Haystack offsets of a draw's needles: the first at `first`, a chain's hops after it in chain order, the
  others at any other boundary."""
  at = [first]
  others = bounds[bounds != first] if bounds.size > 1 else bounds
  later = bounds[bounds >= first]
  for after in d.after_first[1:]:
    at.append(int(rng.choice(later if after else others)))
  if any(d.after_first):  # a chain's hops in chain order: each assignment after the one it reads
    hops = [i for i, a in enumerate(d.after_first) if a]
    for i, v in zip(hops, sorted(at[i] for i in hops)):
      at[i] = v
  return at


def make_example(task: str, *, haystack: Haystack, tokenizer: Any, length: int, depth: float, seed: int,
                 row: bool = False) -> Example:
  """One example of `task` with exactly `length` prompt tokens and its answer needle at `depth`.

  row=True: a training row of `length` tokens (length - 1 input/target pairs): the prompt int32
  [length - answer_room(task, tokenizer) - 1], then the answer, <|endoftext|> and <|endoftext|> padding (the
  caller's to add, up to `length`); the prompt's length thus depends on no drawn answer."""
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; the tasks are {list(TASKS)}")
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth={depth}: expected a fraction in [0, 1]")
  rng = np.random.default_rng([0x7A5C, TASKS.index(task), int(seed)])
  room = answer_room(task, tokenizer) + 1 if row else 0  # the answer and its <|endoftext|>
  for _ in range(64):  # a value that also occurs in the haystack window is redrawn with the next draw
    d = _draw(task, rng)
    intro, question, *needles = [np.asarray(x, np.int32) for x in
                                 _encode(tokenizer, [_INTRO[task], d.question, *d.needles])]
    fixed = len(intro) + len(question) + sum(len(n) for n in needles)
    h = length - fixed - room
    if h < MIN_HAYSTACK:
      room_text = f", the answer's room and <|endoftext|> {room}" if row else ""
      raise ValueError(f"length={length} is too short for task {task!r}: its intro, question and needles take "
                       f"{fixed} tokens{room_text}, and the haystack needs at least {MIN_HAYSTACK} "
                       f"(min_length: {min_length(task, tokenizer, row=row)})")
    hay, bounds = haystack.window(rng, h)
    first = int(bounds[np.argmin(np.abs(bounds - depth * h))])  # nearest boundary; ties: the earlier one
    at = _place(d, bounds, first, rng)
    body, starts = _insert(hay, bounds, needles, at)
    prompt = np.concatenate([intro, body, question]).astype(np.int32)
    order = sorted(d.answer_needles, key=lambda i: (starts[i], i))
    items = [d.answer_items[d.answer_needles.index(i)] for i in order]
    answer_text = d.sep.join(items)
    answer = np.asarray(_encode(tokenizer, [" " + answer_text])[0], np.int32)
    if row:
      _check_room(task, answer, room - 1)
    text = tokenizer.decode(prompt)
    if all(text.count(a) == 1 for a in d.anchors):
      break
  else:
    raise RuntimeError(f"task {task!r} seed {seed}: 64 draws all collided with the haystack")
  return Example(task=task, seed=int(seed), length=int(length), depth=float(depth), prompt=prompt, answer=answer,
                 answer_text=answer_text, answer_anchors=tuple(d.anchors), needle_pos=len(intro) + starts[0],
                 haystack_before=first, haystack_tokens=int(h))


# ---------------------------------------------------------------------------------------------------------------
# Training rows
# ---------------------------------------------------------------------------------------------------------------

# Token kinds of a training row (make_training_row): what a loss mask may select. PADDING: the <|endoftext|>
# tokens that fill the answers' room after the row's closing <|endoftext|>; never a loss target.
OTHER, ANSWER, HAYSTACK, PADDING = 0, 1, 2, 3


PLACEMENTS = ("end", "interleaved")


def make_training_row(tasks: Sequence[str], *, haystack: Haystack, tokenizer: Any, length: int, seed: int,
                      questions: int, placement: str = "end") -> tuple[np.ndarray, np.ndarray]:
  """A training row of exactly `length` tokens that asks `questions` questions about one haystack.

  The needles of `questions` draws (each task uniform over `tasks`, at most one passkey per row, since two pass
  keys would make the question ambiguous) sit at uniformly random sentence boundaries. placement="end": after the
  haystack come the draws' questions, each followed by its answer, in random order, then <|endoftext|>; the first
  question follows the haystack exactly as in an evaluation prompt. placement="interleaved": each question with
  its answer sits at a random boundary after its draw's needles, so the distances from needle to question range
  from a few tokens to the whole row (the short ones are the easy examples a retrieval mechanism first learns
  from), and the row ends with haystack text and <|endoftext|>. One row thus trains `questions` retrievals, where
  an evaluation-format row (`make_example`) trains one. Every anchor of every draw occurs exactly once in the
  intro + haystack + needles, and no key, id or variable is shared by two draws.

  Either placement reserves each question answer_room(task, tokenizer) tokens and the closing <|endoftext|> one;
  what the drawn answers leave of that is <|endoftext|> padding at the very end of the row, after the closing
  <|endoftext|>. The haystack's length thus depends on the intro, needles and questions only, and a question's
  position on those and the answers before it (which the model sees), never on its own answer's token count.

  Returns (tokens int32 [length], kinds int8 [length]: ANSWER for answer tokens (and the closing <|endoftext|>
  with placement="end"), HAYSTACK for real text, OTHER for the intro, needles and questions (and the closing
  <|endoftext|> with placement="interleaved"), PADDING for the padding).
  """
  if placement not in PLACEMENTS:
    raise ValueError(f"placement={placement!r}: expected one of {PLACEMENTS}")
  if questions < 1:
    raise ValueError(f"questions={questions}: expected >= 1")
  tasks = list(tasks)
  unknown = [t for t in tasks if t not in TASKS]
  if unknown or not tasks:
    raise ValueError(f"tasks {tasks}: expected a non-empty list of {list(TASKS)}")
  if questions > 1 and all(t == "passkey" for t in tasks):
    raise ValueError(f"questions={questions} with only passkey: a row holds one pass key (two would be ambiguous)")
  rng = np.random.default_rng([0x7A5D, int(seed)])
  room_of = {t: answer_room(t, tokenizer) for t in set(tasks)}
  for _ in range(64):
    names: list[str] = []
    for _q in range(questions):
      pool = [t for t in tasks if t != "passkey"] if "passkey" in names else tasks
      names.append(pool[int(rng.integers(len(pool)))])
    draws = [_draw(t, rng) for t in names]
    keys = [k for d in draws for k in d.keys]
    if len(set(keys)) != len(keys):
      continue
    intro = np.asarray(_encode(tokenizer, [_INTRO[names[int(rng.integers(questions))]]])[0], np.int32)
    enc = _encode(tokenizer, [x for d in draws for x in [d.question, *d.needles]])
    questions_ids, needle_ids, k = [], [], 0
    for d in draws:
      questions_ids.append(np.asarray(enc[k], np.int32))
      needle_ids.append([np.asarray(x, np.int32) for x in enc[k + 1:k + 1 + len(d.needles)]])
      k += 1 + len(d.needles)
    fixed = len(intro) + sum(len(q) for q in questions_ids) + sum(len(n) for ns in needle_ids for n in ns)
    room = sum(room_of[t] for t in names) + 1  # the answers and the closing <|endoftext|>
    h = length - fixed - room
    if h < MIN_HAYSTACK:
      raise ValueError(f"length={length} is too short for {questions} questions of {tasks}: intro, needles and "
                       f"questions take {fixed} tokens, the answers' room and <|endoftext|> {room}, and the "
                       f"haystack needs {MIN_HAYSTACK}")
    hay, bounds = haystack.window(rng, h)
    flat, at = [], []
    for d, ns in zip(draws, needle_ids):
      flat += ns
      at += _place(d, bounds, int(rng.choice(bounds)), rng)
    answers, k = [], 0
    for d in draws:  # a multi-item answer lists its items in text order: the needles' (offset, index) order
      order = sorted(d.answer_needles, key=lambda i: (at[k + i], k + i))
      answers.append(d.sep.join(d.answer_items[d.answer_needles.index(i)] for i in order))
      k += len(d.needles)
    answer_ids = [np.asarray(a, np.int32) for a in _encode(tokenizer, [" " + a for a in answers])]
    for t, a in zip(names, answer_ids):
      _check_room(t, a, room_of[t])
    segments = list(flat)  # needles, then (interleaved) the question + answer pieces: ties put them after
    seg_kinds = [np.full(len(n), OTHER, np.int8) for n in flat]
    if placement == "interleaved":
      k = 0
      for q, d in enumerate(draws):
        last = max(at[k:k + len(d.needles)])
        k += len(d.needles)
        segments.append(np.concatenate([questions_ids[q], answer_ids[q]]))
        seg_kinds.append(np.concatenate([np.full(len(questions_ids[q]), OTHER, np.int8),
                                         np.full(len(answer_ids[q]), ANSWER, np.int8)]))
        at.append(int(rng.choice(bounds[bounds >= last])))
    body, starts = _insert(hay, bounds, segments, at)
    body_kinds = np.full((len(body),), HAYSTACK, np.int8)
    for st, sk in zip(starts, seg_kinds):
      body_kinds[st:st + len(sk)] = sk
    context = body if placement == "end" else body[body_kinds != ANSWER]
    text = tokenizer.decode(np.concatenate([intro, context]))
    if not all(text.count(a) == 1 for d in draws for a in d.anchors):
      continue
    parts = [(intro, np.full(len(intro), OTHER, np.int8)), (body, body_kinds)]
    if placement == "end":
      for q in rng.permutation(questions):
        parts += [(questions_ids[q], np.full(len(questions_ids[q]), OTHER, np.int8)),
                  (answer_ids[q], np.full(len(answer_ids[q]), ANSWER, np.int8))]
    parts.append((np.asarray([EOT], np.int32), np.asarray([ANSWER if placement == "end" else OTHER], np.int8)))
    pad = room - 1 - sum(len(a) for a in answer_ids)
    parts.append((np.full(pad, EOT, np.int32), np.full(pad, PADDING, np.int8)))
    tokens = np.concatenate([p for p, _ in parts]).astype(np.int32)
    kinds = np.concatenate([k for _, k in parts]).astype(np.int8)
    assert tokens.shape == (length,), (tokens.shape, length)
    return tokens, kinds
  raise RuntimeError(f"training row seed {seed}: 64 draws all collided (shared keys or values in the haystack)")



class TaskRows(Sequence):
  """Random-access source of task rows for grain (`grain.MapDataset.source`): row i is drawn from (seed, i) as a
  batch-contract row {inputs, targets, segment_ids, positions, loss_mask} of [seq_len] each.

  questions=1, text_loss=False, placement="end", no lengths: an evaluation-format example (`make_example`, task and
  depth uniform) whose loss covers only the answer and the <|endoftext|> after it, not the padding that fills the
  answer's room (see `make_example`). Otherwise `make_training_row` examples with `questions` questions placed as
  `placement` says; text_loss=True also puts the loss on the haystack text (not on needles, questions or padding),
  so task rows stop displacing language-model training.

  lengths (example lengths in tokens, e.g. (512, 2048, 16384)): each row picks one uniformly and holds
  (seq_len + 1) // L examples of that length, each its own segment with positions from 0, so under document
  masking a question attends over its own example only. The remainder of the row joins the last example when it
  is at most L // 16 tokens; a longer one is a segment of <|endoftext|> padding without loss, so that no example
  is much longer than its L (a 384 in a 513-token row would otherwise be a 513-token example). Short examples
  are where a retrieval mechanism is learnt first (at initialisation attention is spread over every visible key:
  1/L of it on the needle); the long ones train the full length. Short examples ask fewer questions: as many of
  `questions` as fit in half of the example.
  """

  def __init__(self, haystack: Haystack, tokenizer: Any, *, seq_len: int, seed: int,
               tasks: Sequence[str] = TASKS, size: int = 2 ** 40, questions: int = 1, text_loss: bool = False,
               placement: str = "end", lengths: Sequence[int] = ()):
    self._hay, self._tok = haystack, tokenizer
    if placement not in PLACEMENTS:
      raise ValueError(f"data.tasks.placement={placement!r}: expected one of {PLACEMENTS}")
    self._placement = placement
    self._seq_len, self._seed, self._tasks, self._size = int(seq_len), int(seed), list(tasks), int(size)
    self._questions, self._text_loss = int(questions), bool(text_loss)
    self._lengths = sorted({int(n) for n in lengths})
    if self._questions < 1:
      raise ValueError(f"data.tasks.questions={questions}: expected >= 1")
    if self._questions > 1 and all(t == "passkey" for t in self._tasks):
      raise ValueError(f"data.tasks.questions={questions} with names=passkey only: a row holds one pass key")
    # each question brings about its task's fixed tokens and answer room (min_length less the haystack minimum)
    self._per_question = max(min_length(t, tokenizer, row=True) for t in self._tasks) - MIN_HAYSTACK
    need = self._per_question * self._questions + MIN_HAYSTACK
    short = [t for t in self._tasks if min_length(t, tokenizer, row=True) > seq_len + 1 - 16]
    if short or need > seq_len + 1 - 16:
      raise ValueError(f"data.tasks: seq_len={seq_len} is too short for {self._questions} question(s) of tasks "
                       f"{short or self._tasks} (they need about {need + 16} tokens)")
    if self._lengths and not (2 * self._per_question + MIN_HAYSTACK <= self._lengths[0]
                              and self._lengths[-1] <= self._seq_len + 1):
      raise ValueError(f"data.tasks.lengths={self._lengths}: expected example lengths from "
                       f"{2 * self._per_question + MIN_HAYSTACK} (one question in half an example) to seq_len + 1 "
                       f"= {self._seq_len + 1}")

  def _questions_for(self, length: int) -> int:
    return max(1, min(self._questions, (length // 2) // self._per_question))

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, i) -> dict[str, np.ndarray]:
    if self._lengths:
      return self._packed(int(i))
    if self._questions > 1 or self._text_loss or self._placement != "end":
      tokens, kinds = make_training_row(self._tasks, haystack=self._hay, tokenizer=self._tok,
                                        length=self._seq_len + 1, seed=seed32(self._seed, int(i)),
                                        questions=self._questions, placement=self._placement)
      on = (kinds[1:] == ANSWER) | ((kinds[1:] == HAYSTACK) & self._text_loss)  # per target token
      return {"inputs": tokens[:-1], "targets": tokens[1:], "segment_ids": np.ones((self._seq_len,), np.int32),
              "positions": np.arange(self._seq_len, dtype=np.int32), "loss_mask": on.astype(np.float32)}
    rng = np.random.default_rng([self._seed, int(i)])
    task = self._tasks[int(rng.integers(len(self._tasks)))]
    ex = make_example(task, haystack=self._hay, tokenizer=self._tok, length=self._seq_len + 1,
                      depth=float(rng.random()), seed=seed32(self._seed, int(i)), row=True)
    p, a = len(ex.prompt), len(ex.answer)
    full = np.full((self._seq_len + 1,), EOT, np.int32)  # after the answer: <|endoftext|>, then the padding
    full[:p], full[p:p + a] = ex.prompt, ex.answer
    mask = np.zeros((self._seq_len,), np.float32)
    mask[p - 1:p + a] = 1.0  # targets from the answer's first token to the closing <|endoftext|>
    return {"inputs": full[:-1], "targets": full[1:], "segment_ids": np.ones((self._seq_len,), np.int32),
            "positions": np.arange(self._seq_len, dtype=np.int32), "loss_mask": mask}


  def _packed(self, i: int) -> dict[str, np.ndarray]:
    """A row of examples of one length drawn from `lengths`, each its own segment."""
    total = self._seq_len + 1
    rng = np.random.default_rng([self._seed, i, 1])
    length = self._lengths[int(rng.integers(len(self._lengths)))]
    n, rest = divmod(total, length)
    sizes = [length] * n
    if rest <= length // 16:
      sizes[-1] += rest
      rest = 0
    toks, kinds, seg, pos = [], [], [], []
    for j, size in enumerate(sizes):
      t, k = make_training_row(self._tasks, haystack=self._hay, tokenizer=self._tok, length=size,
                               seed=seed32(self._seed, i, j), questions=self._questions_for(size),
                               placement=self._placement)
      toks.append(t)
      kinds.append(k)
      seg.append(np.full((size,), j + 1, np.int32))
      pos.append(np.arange(size, dtype=np.int32))
    if rest:
      toks.append(np.full((rest,), EOT, np.int32))
      kinds.append(np.full((rest,), PADDING, np.int8))
      seg.append(np.full((rest,), n + 1, np.int32))
      pos.append(np.arange(rest, dtype=np.int32))
    tokens, kinds, seg, pos = (np.concatenate(x) for x in (toks, kinds, seg, pos))  # [seq_len + 1] each
    on = (kinds[1:] == ANSWER) | ((kinds[1:] == HAYSTACK) & self._text_loss)  # per target token
    on &= seg[1:] == seg[:-1]  # no target across two examples
    return {"inputs": tokens[:-1], "targets": tokens[1:], "segment_ids": seg[:-1], "positions": pos[:-1],
            "loss_mask": on.astype(np.float32)}


def mix_task_rows(text_rows: grain.IterDataset, data_dir: str, *, share: float, tasks: Sequence[str],
                  seq_len: int, seed: int, process_index: int = 0, process_count: int = 1,
                  max_haystack_chars: int = 4_000_000, questions: int = 1, text_loss: bool = False,
                  placement: str = "end", lengths: Sequence[int] = ()) -> grain.IterDataset:
  """Packed text rows -> the same stream where a share `share` of the rows are task rows (haystack: the train
  split of `data_dir`, its first `max_haystack_chars` characters; `questions`, `text_loss`, `placement`,
  `lengths`: see TaskRows);
  deterministic and resumable like the text."""
  if not 0.0 < share < 1.0:
    raise ValueError(f"data.tasks.share={share}: expected a fraction in (0, 1) (0 disables the task rows)")
  tok = load_tokenizer(data_dir)
  hay = Haystack.from_corpus(data_dir, tokenizer=tok, split="train", max_chars=max_haystack_chars)
  rows = TaskRows(hay, tok, seq_len=seq_len, seed=seed32(seed, 0x7A5C), tasks=tasks, questions=questions,
                  text_loss=text_loss, placement=placement, lengths=lengths)
  # Read inline: grain's default read-ahead would generate a thousand rows before the first batch.
  task_ds = grain.MapDataset.source(rows)[process_index::process_count].to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=16))
  return grain.IterDataset.mix([text_rows, task_ds], [1.0 - share, share])
