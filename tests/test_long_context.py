"""Long-context tasks and their evaluation: the task generators' contract (exact lengths, the answer once, at the
requested depth, deterministic), task rows in the training pipeline, and `python -m m3_jax.eval_long` end to end
on an exported MSA model (whose cached decoding must give the full forward's greedy tokens) and an HF fixture."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from m3_jax import eval_long, inference
from m3_jax.core.batch import EOT, TEXT_KEYS
from m3_jax.data import long_tasks as lt
from m3_jax.data import text_pipeline, text_prepare
from m3_jax.data.tokenizer import train_bpe
from m3_jax.train import evaluation, trainer
from tests.train_utils import REPO, license_texts, small_config

LENGTH = 400
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A prepared corpus of licence texts (vocab 512), its tokenizer and the held-out haystack."""
  d = str(tmp_path_factory.mktemp("long_data"))
  text_prepare.prepare(d, sources=(), text_files={"licenses": license_texts()}, vocab_size=512, verbose=False)
  tok = text_prepare.load_tokenizer(d)
  return d, tok, lt.Haystack.from_corpus(d, tokenizer=tok)


@pytest.fixture(scope="module")
def digit_corpus():
  """A byte-level BPE whose digit merges make the answers' token counts vary from draw to draw (the corpus
  tokenizer above gives every 5- or 7-digit number one token per digit), and the licence texts as its haystack."""
  texts = []
  for path in license_texts():
    with open(path) as f:
      texts.append(f.read())
  rng = np.random.default_rng(0)
  digits = rng.choice(list("0123456789"), size=12000, p=[.3, .2, .1, .1] + [.05] * 6)  # a skewed mix: some pairs merge
  numbers = " ".join("".join(digits[i:i + 4]) for i in range(0, len(digits), 4))
  tok = train_bpe(texts + [numbers], vocab_size=768)
  return tok, lt.Haystack.from_texts(texts, tok)


def _after_the_closing_eot(targets: np.ndarray, on: np.ndarray) -> int:
  """How many targets follow the row's last loss target, after checking that they are all <|endoftext|> padding
  without loss."""
  last = int(np.flatnonzero(on)[-1])
  assert (targets[last + 1:] == EOT).all() and not on[last + 1:].any()
  return len(targets) - 1 - last


@pytest.mark.parametrize("task", lt.TASKS)
def test_examples_have_exact_length_one_answer_at_the_requested_depth(corpus, task):
  _, tok, hay = corpus
  intro = len(tok.encode(lt._INTRO[task]))  # noqa: SLF001  (the test measures the intro it must skip)
  for seed in (0, 1):
    for depth in DEPTHS:
      ex = lt.make_example(task, haystack=hay, tokenizer=tok, length=LENGTH, depth=depth, seed=seed)
      assert ex.prompt.shape == (LENGTH,) and ex.prompt.dtype == np.int32
      text = tok.decode(ex.prompt)
      for anchor in ex.answer_anchors:
        assert text.count(anchor) == 1, (task, seed, depth, anchor)
      items = ex.answer_text.split(", ")
      assert all(text.count(item) >= 1 for item in items)
      assert tok.decode(ex.answer) == " " + ex.answer_text
      # The answer needle starts at needle_pos: its sentence holds the first drawn answer item.
      needle = tok.decode(ex.prompt[ex.needle_pos:]).split(".")[0]
      assert any(item in needle for item in items), (task, needle)
      # Depth: the nearest sentence boundary, sentences of at most max_sentence_tokens.
      h = ex.haystack_tokens
      assert abs(ex.haystack_before - depth * h) <= hay.max_sentence_tokens / 2, (task, depth, ex.haystack_before)
      if task in ("passkey", "single_key"):  # one needle: everything before it is intro and haystack
        assert ex.needle_pos == intro + ex.haystack_before
      if depth == 0.0:
        assert ex.needle_pos == intro
      if depth == 1.0 and task == "passkey":
        assert text.endswith("Remember it.\nWhat is the pass key? The pass key is")


def test_same_seed_same_example_other_seed_other_example(corpus):
  _, tok, hay = corpus
  for task in lt.TASKS:
    a, b, c = (lt.make_example(task, haystack=hay, tokenizer=tok, length=LENGTH, depth=0.5, seed=s)
               for s in (7, 7, 8))
    np.testing.assert_array_equal(a.prompt, b.prompt)
    np.testing.assert_array_equal(a.answer, b.answer)
    assert a.answer_text != c.answer_text and not np.array_equal(a.prompt, c.prompt)


def test_bad_arguments_are_named(corpus):
  _, tok, hay = corpus
  with pytest.raises(ValueError, match="unknown task"):
    lt.parse_tasks("passkey,needle")
  with pytest.raises(ValueError, match="too short"):
    lt.make_example("multi_key", haystack=hay, tokenizer=tok, length=60, depth=0.5, seed=0)
  with pytest.raises(ValueError, match="depth"):
    lt.make_example("passkey", haystack=hay, tokenizer=tok, length=LENGTH, depth=1.5, seed=0)
  assert all(lt.min_length(t, tok) <= LENGTH for t in lt.TASKS)


def test_training_rows_mix_task_rows_with_loss_on_the_answer(corpus):
  d, tok, _ = corpus
  kw = dict(seq_len=512, global_batch_size=8, seed=3, task_share=0.5, tasks="passkey,kv,vt")
  it = iter(text_pipeline.make_train_dataset(d, **kw))
  batches = [next(it) for _ in range(3)]
  state = it.get_state()
  after = next(it)
  again = iter(text_pipeline.make_train_dataset(d, **kw))
  for b in batches:
    assert sorted(b) == sorted(TEXT_KEYS) and all(v.shape == (8, 512) for v in b.values())
    np.testing.assert_array_equal(b["inputs"], next(again)["inputs"])
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["inputs"], after["inputs"])
  rows = [(b, i) for b in batches for i in range(8)]
  task_rows = [(b, i) for b, i in rows if b["loss_mask"][i].sum() < 40]
  assert 0 < len(task_rows) < len(rows)
  for b, i in task_rows:
    m = b["loss_mask"][i] > 0
    assert b["targets"][i][m][-1] == EOT and (b["segment_ids"][i] == 1).all()
    _after_the_closing_eot(b["targets"][i], m)
    answer = tok.decode(b["targets"][i][m][:-1])
    first = int(np.argmax(m))
    question = tok.decode(b["inputs"][i][:first + 1])
    assert question.rstrip().endswith((" is", " are")) and answer.startswith(" ")
    assert question.count(answer.strip().split(", ")[0]) >= 1  # the answer is in the context


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
  """[start, end) of each run of True in a 1-D bool array."""
  edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
  return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def _in_haystack(hay: lt.Haystack, run: np.ndarray) -> bool:
  """Whether `run` is a contiguous piece of the haystack's tokens (a window may wrap around the end)."""
  doubled = np.concatenate([hay.tokens, hay.tokens]).astype(np.int32).tobytes()
  at = doubled.find(run.astype(np.int32).tobytes())
  while at >= 0 and at % 4:
    at = doubled.find(run.astype(np.int32).tobytes(), at + 1)
  return at >= 0


NEEDLE_WORDS = ("pass key", "special number", "value of key", "VAR ")


@pytest.mark.parametrize("placement", lt.PLACEMENTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_row_asks_each_question_once_about_its_haystack(corpus, seed, placement):
  d, tok, _ = corpus
  hay = lt.Haystack.from_corpus(d, tokenizer=tok, split="train")
  q, length = 5, 1500
  kw = dict(haystack=hay, tokenizer=tok, length=length, seed=seed, questions=q, placement=placement)
  toks, kinds = lt.make_training_row(lt.TASKS, **kw)
  again = lt.make_training_row(lt.TASKS, **kw)
  np.testing.assert_array_equal(toks, again[0])
  np.testing.assert_array_equal(kinds, again[1])
  assert toks.shape == kinds.shape == (length,)
  closing = int(np.flatnonzero(kinds != lt.PADDING)[-1])  # then only <|endoftext|> padding
  assert toks[closing] == EOT and (toks[closing:] == EOT).all()
  assert kinds[closing] == (lt.ANSWER if placement == "end" else lt.OTHER)
  answers = [(a, b) for a, b in _runs(kinds == lt.ANSWER) if toks[a] != EOT]
  assert len(answers) == q
  assert tok.decode(toks).count("What is the pass key?") <= 1
  for a, b in answers:
    answer = tok.decode(toks[a:b][toks[a:b] != EOT])
    assert answer.startswith(" ") and tok.decode(toks[:a]).rstrip().endswith((" is", " are"))
    # what came before the answer, other answers left out: each item stands there exactly once, in its needle
    context = tok.decode(toks[:a][kinds[:a] != lt.ANSWER])
    for item in answer.strip().split(", "):
      anchor = f"VAR {item} =" if item.isalpha() and item.isupper() else item  # a variable: its assignment
      assert context.count(anchor) == 1, (seed, placement, item)
  for a, b in _runs(kinds == lt.HAYSTACK):
    assert _in_haystack(hay, toks[a:b])
    assert not any(w in tok.decode(toks[a:b]) for w in NEEDLE_WORDS)
  if placement == "end":
    assert (kinds[answers[0][0]:] != lt.HAYSTACK).all()  # the questions come after the whole haystack
  else:  # spread over the row: the first answer well before the end
    assert answers[0][0] < length - 200
  with pytest.raises(ValueError, match="one pass key"):
    lt.make_training_row(["passkey"], **{**kw, "questions": 2})
  with pytest.raises(ValueError, match="too short"):
    lt.make_training_row(lt.TASKS, **{**kw, "length": 200})
  with pytest.raises(ValueError, match="placement"):
    lt.make_training_row(lt.TASKS, **{**kw, "placement": "middle"})


def test_task_rows_loss_on_answers_and_optionally_the_haystack(corpus):
  d, tok, _ = corpus
  hay = lt.Haystack.from_corpus(d, tokenizer=tok, split="train")
  kw = dict(seq_len=2047, seed=4, tasks=("single_key", "kv", "vt"), questions=4)
  answers_only, with_text = lt.TaskRows(hay, tok, **kw), lt.TaskRows(hay, tok, text_loss=True, **kw)
  for i in range(3):
    a, t = answers_only[i], with_text[i]
    np.testing.assert_array_equal(a["inputs"], t["inputs"])
    np.testing.assert_array_equal(a["targets"][:-1], a["inputs"][1:])
    on, on_text = a["loss_mask"] > 0, t["loss_mask"] > 0
    runs = _runs(on)
    assert len(runs) == 4 and a["targets"][runs[-1][1] - 1] == EOT
    _after_the_closing_eot(a["targets"], on)
    for s, e in runs:  # each masked run is an answer right after its question
      assert tok.decode(a["inputs"][:s + 1]).rstrip().endswith((" is", " are"))
    extra = on_text & ~on
    assert (on_text >= on).all() and extra.sum() > 0.5 * len(extra)
    for s, e in _runs(extra):
      assert _in_haystack(hay, t["targets"][s:e])
      assert not any(w in tok.decode(t["targets"][s:e]) for w in NEEDLE_WORDS)
  with pytest.raises(ValueError, match="too short"):
    lt.TaskRows(hay, tok, seq_len=300, seed=0, tasks=lt.TASKS, questions=8)


def test_task_rows_pack_short_examples_as_segments(corpus):
  d, tok, _ = corpus
  hay = lt.Haystack.from_corpus(d, tokenizer=tok, split="train")
  lengths = (700, 1400, 2800)
  rows = lt.TaskRows(hay, tok, seq_len=2799, seed=2, tasks=("single_key", "kv"), questions=3, lengths=lengths)
  seen = set()
  for i in range(12):
    r = rows[i]
    seg, pos, on = r["segment_ids"], r["positions"], r["loss_mask"] > 0
    ids = np.unique(seg)
    np.testing.assert_array_equal(ids, np.arange(1, len(ids) + 1))  # segments 1..n in order
    sizes = [int((seg == j).sum()) for j in ids]
    length = max(n for n in lengths if n <= sizes[0] + 1)  # the last segment also holds the remainder
    seen.add(length)
    assert len(ids) == 2800 // length and all(n == length for n in sizes[:-1])
    for j in ids:  # positions restart in every example; its tokens are a whole training row of that length
      m = seg == j
      np.testing.assert_array_equal(pos[m], np.arange(m.sum()))
    starts = np.flatnonzero(np.diff(seg)) + 1  # first input of each later segment
    assert not on[starts - 1].any()  # no target across two examples
    runs = _runs(on)
    assert runs and all(tok.decode(r["inputs"][:a + 1]).rstrip().endswith((" is", " are")) for a, _ in runs)
    # each answer's items stand once in the context of its own example, before it
    for a, b in runs:
      j = seg[a]
      own = (seg == j) & (np.arange(len(seg)) <= a)
      context = tok.decode(r["inputs"][own])
      for item in tok.decode(r["targets"][a:b][r["targets"][a:b] != EOT]).strip().split(", "):
        assert context.count(item) == 1, (i, item)
  assert seen == set(lengths)
  with pytest.raises(ValueError, match="lengths"):
    lt.TaskRows(hay, tok, seq_len=2799, seed=2, tasks=("single_key",), lengths=(100, 2800))


@pytest.mark.parametrize("length,sizes,padding", [(930, [930, 930, 940], 0), (1000, [1000, 1000], 800)])
def test_task_rows_remainder_joins_the_last_example_or_is_padding(corpus, length, sizes, padding):
  """2800-token rows: 3 x 930 leave 10 tokens (<= 930 // 16), which the last example takes; 2 x 1000 leave 800,
  which become a segment of <|endoftext|> without loss, not a 1800-token example."""
  d, tok, _ = corpus
  hay = lt.Haystack.from_corpus(d, tokenizer=tok, split="train")
  rows = lt.TaskRows(hay, tok, seq_len=2799, seed=3, tasks=("single_key", "kv"), questions=3, lengths=(length,))
  for i in range(3):
    r = rows[i]
    tokens = np.concatenate([r["inputs"], r["targets"][-1:]])  # the row's 2800 tokens
    seg = np.concatenate([r["segment_ids"], r["segment_ids"][-1:]])
    ids = np.unique(seg)
    got = [int((seg == j).sum()) for j in ids]
    assert got == sizes + ([padding] if padding else []), got
    if padding:
      pad = seg == ids[-1]
      assert (tokens[pad] == EOT).all()
      assert not (r["loss_mask"] > 0)[pad[1:]].any()  # no target inside the padding
    assert (r["loss_mask"] > 0).any()


# The leak these guard against: a row of exactly `length` tokens whose haystack shrinks by the answer's token
# count, so that where a question ends tells the model how long its answer is (evaluation prompts carry no such
# clue). Measured: answer NLL 3.15 nats in that format against 4.47 in the evaluation format.


@pytest.mark.parametrize("task", lt.TASKS)
def test_row_prompt_length_does_not_tell_the_answer_length(digit_corpus, task):
  tok, hay = digit_corpus
  exs = [lt.make_example(task, haystack=hay, tokenizer=tok, length=LENGTH, depth=0.5, seed=s, row=True)
         for s in range(24)]
  assert len({len(e.answer) for e in exs}) > 1  # the draws' answers do differ in token count
  assert len({len(e.prompt) for e in exs}) == 1, sorted({(len(e.answer), len(e.prompt)) for e in exs})
  assert all(len(e.prompt) + len(e.answer) + 1 <= LENGTH for e in exs)
  again = lt.make_example(task, haystack=hay, tokenizer=tok, length=LENGTH, depth=0.5, seed=3, row=True)
  np.testing.assert_array_equal(again.prompt, exs[3].prompt)
  np.testing.assert_array_equal(again.answer, exs[3].answer)


@pytest.mark.parametrize("placement", lt.PLACEMENTS)
@pytest.mark.parametrize("task", [t for t in lt.TASKS if t != "passkey"])
def test_training_row_question_positions_do_not_tell_the_answer_lengths(digit_corpus, task, placement):
  tok, hay = digit_corpus
  answer_tokens, context, ends = set(), set(), set()
  for seed in range(12):
    toks, kinds = lt.make_training_row([task], haystack=hay, tokenizer=tok, length=1200, seed=seed, questions=3,
                                       placement=placement)
    answer_tokens.add(int(((kinds == lt.ANSWER) & (toks != EOT)).sum()))
    context.add(int(np.isin(kinds, (lt.OTHER, lt.HAYSTACK)).sum()))  # intro, haystack, needles and questions
    if placement == "end":
      # Where each question ends, less the answers before it (in view) and plus the questions after it (not
      # answers), is where the block of questions would end without answers: the same in every row.
      for a, _ in _runs(kinds == lt.ANSWER):
        if toks[a] != EOT:
          ends.add(a - int((kinds[:a] == lt.ANSWER).sum()) + int((kinds[a:] == lt.OTHER).sum()))
  assert len(answer_tokens) > 1  # the drawn answers differ in token count
  assert len(context) == 1, (answer_tokens, context)
  assert placement != "end" or len(ends) == 1, ends


def test_task_rows_padding_after_the_answer_carries_no_loss(digit_corpus):
  tok, hay = digit_corpus
  padded = 0
  for kw in (dict(seq_len=LENGTH - 1), dict(seq_len=1199, questions=3, text_loss=True),
             dict(seq_len=1199, questions=3, text_loss=True, placement="interleaved")):
    rows = lt.TaskRows(hay, tok, seed=5, tasks=lt.TASKS, **kw)
    for i in range(6):
      r = rows[i]
      on = r["loss_mask"] > 0
      last = int(np.flatnonzero(on)[-1])
      after = _after_the_closing_eot(r["targets"], on)
      if kw.get("placement") == "interleaved":  # the row's closing <|endoftext|> is no loss target there
        assert r["targets"][last] != EOT and r["targets"][last + 1] == EOT
        after -= 1
      else:
        assert r["targets"][last] == EOT
      padded += after > 0
      if "questions" not in kw:  # the evaluation format: one loss run, the answer and its <|endoftext|>
        (s, e), = _runs(on)
        assert e == last + 1 and tok.decode(r["inputs"][:s + 1]).rstrip().endswith((" is", " are"))
        answer = tok.decode(r["targets"][s:e - 1])
        assert answer.startswith(" ") and EOT not in r["targets"][s:e - 1]
        context = tok.decode(r["inputs"][:s + 1])
        assert all(context.count(item) >= 1 for item in answer.strip().split(", "))
  assert padded > 0  # the room exceeds some drawn answers
  packed = lt.TaskRows(hay, tok, seq_len=1199, seed=5, tasks=("kv", "vt"), questions=2, lengths=(600, 1200))
  for i in range(4):
    r = packed[i]
    seg, on = r["segment_ids"], r["loss_mask"] > 0
    for j in np.unique(seg):
      idx = np.flatnonzero(seg == j)
      idx = idx if j == seg[-1] else idx[:-1]  # a segment's last target is the next example's first token
      _after_the_closing_eot(r["targets"][idx], on[idx])
      assert r["targets"][idx][on[idx]][-1] == EOT


# ---------------------------------------------------------------------------------------------------------------
# python -m m3_jax.eval_long
# ---------------------------------------------------------------------------------------------------------------

HF_MSA = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "text_msa")


@pytest.fixture(scope="module")
def msa_export(corpus, tmp_path_factory):
  """A tiny MSA model (layer 0 dense, layer 1 MSA: block 8, top-2 of 24 blocks at 192 tokens) trained for 2 steps
  on licence text with passkey task rows in its batches, exported (bf16) as --mode=export writes it."""
  d = corpus[0]
  work = str(tmp_path_factory.mktemp("msa_run"))
  cfg = small_config(d, **{"train.steps": 2, "train.seq_len": 192, "data.tasks.share": 0.5,
                           "data.tasks.names": "passkey", "model.layer_types": ("full_attention", "minimax_m3_sparse"),
                           "model.mlp_layer_types": ("dense", "dense"), "model.index_n_heads": 2,
                           "model.index_head_dim": 8, "model.index_block_size": 8, "model.index_topk_blocks": 2,
                           "eval.max_batches": 1})
  trainer.train_and_evaluate(cfg, work)
  return evaluation.export(cfg, work)


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
  """A character-level HF tokenizer (97 ids) for the HF fixture, whose vocabulary has 256 entries."""
  chars = [chr(i) for i in range(32, 127)] + ["\n"]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}},
                                                         unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), "isolated")
  tok.decoder = tokenizers.decoders.Fuse()
  path = str(tmp_path_factory.mktemp("char_tok") / "tokenizer.json")
  tok.save(path)
  return path


def full_forward_greedy(model, prompts, lengths, n):
  """The oracle: n greedy tokens per row, each the argmax of a fresh full forward over the row's prompt (its first
  lengths[i] tokens of prompts [B, T]) and its tokens so far; one compiled shape, as right padding cannot reach
  earlier positions of a causal model."""
  b, t = prompts.shape
  buf = np.zeros((b, t + n), np.int32)
  buf[:, :t] = prompts
  rows, lengths = np.arange(b), np.asarray(lengths)
  fwd = jax.jit(lambda ids: model(ids)[0])
  for i in range(n):
    logits = np.asarray(fwd(jnp.asarray(buf)))  # [B, T + n, V]
    buf[rows, lengths + i] = logits[rows, lengths + i - 1].argmax(-1)
  return buf[rows[:, None], lengths[:, None] + np.arange(n)]  # [B, n]


def check_outputs(out, tasks, lengths, depths):
  with open(os.path.join(out, "results.json")) as f:
    res = json.load(f)
  assert sorted(res["tasks"]) == sorted(tasks)
  for task in tasks:
    r = res["tasks"][task]
    assert [(c["length"], c["depth"]) for c in r["cells"]] == [(n, d) for n in lengths for d in depths]
    assert all(0.0 <= c["accuracy"] <= 1.0 and c["n"] == 1 for c in r["cells"])
    assert r["accuracy"] == np.mean([e["exact"] for e in r["examples"]])
    with open(os.path.join(out, f"heatmap_{task}.png"), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(os.path.join(out, "loss_by_position.json")) as f:
    loss = json.load(f)
  assert loss["documents"] >= 1 and len(loss["curve"]) == loss["length"]
  assert all(np.isfinite(b["loss"]) and b["loss"] > 0 for b in loss["bins"])
  assert os.path.getsize(os.path.join(out, "loss_by_position.png")) > 0
  assert not os.path.exists(os.path.join(out, eval_long.PROGRESS))  # a finished evaluation keeps results.json only
  return res


def check_decoding_against_full_forward(res, checkpoint, tokenizer, data_dir, **args):
  """Acceptance 2 of issue 19: the command's answers (chunked prefill, then decoding with the KV and index caches)
  are the greedy tokens of a full forward recomputed at every step, for every example it ran."""
  tok = eval_long.load_tokenizer(checkpoint, tokenizer, data_dir)
  hay = lt.Haystack.from_corpus(data_dir, tokenizer=tok)
  exs = [e for v in eval_long.make_examples(**args, haystack=hay, tokenizer=tok).values() for e in v]
  got = {(r["length"], r["depth"], r["seed"]): r["generated_ids"] for t in res["tasks"].values() for r in t["examples"]}
  n = max(len(g) for g in got.values())
  longest = max(e.length for e in exs)
  prompts = np.zeros((len(exs), longest), np.int32)  # right padding: later positions cannot reach earlier ones
  for i, e in enumerate(exs):
    prompts[i, :e.length] = e.prompt
  model, _ = inference.load_model(checkpoint)
  ref = full_forward_greedy(model, prompts, [e.length for e in exs], n)
  for i, e in enumerate(exs):
    g = got[e.length, e.depth, e.seed]
    np.testing.assert_array_equal(g, ref[i, :len(g)], err_msg=f"{e.task} length {e.length} depth {e.depth}")


def test_eval_long_on_an_msa_export_answers_as_the_full_forward(corpus, msa_export, tmp_path, capsys):
  out = str(tmp_path / "eval")
  res = eval_long.evaluate(checkpoint=msa_export, tasks="passkey,single_key", lengths="192,256",
                           depths="0,0.5,1", samples=1, out=out, data_dir=corpus[0], batch_size=4,
                           prefill_chunk=64, loss_length=256, loss_bins=4)
  check_outputs(out, ["passkey", "single_key"], [192, 256], [0.0, 0.5, 1.0])
  assert res["layer_types"] == ["full_attention", "minimax_m3_sparse"]
  lines = [x for x in capsys.readouterr().out.splitlines() if " accuracy " in x]
  assert len(lines) == 4 and all(x.rstrip().endswith(" s") for x in lines)  # one per (length, task), timed
  check_decoding_against_full_forward(res, msa_export, "", corpus[0], tasks=["passkey", "single_key"],
                                      lengths=[192, 256], depths=[0.0, 0.5, 1.0], samples=1, seed=0)
  check_answer_logprobs(res, msa_export, corpus[0], tasks=["passkey", "single_key"], lengths=[192, 256],
                        depths=[0.0, 0.5, 1.0], samples=1, seed=0)
  fc = res["forward_check"]
  assert fc["argmax_agree"] == 1.0 and fc["max_abs_logprob_diff"] < LOGPROB_TOL, fc


# The cached path and a full forward sum in different orders: measured <= 3.8e-6 nats per answer on this model.
LOGPROB_TOL = 1e-4


def check_answer_logprobs(res, checkpoint, data_dir, **args):
  """Each example's answer_logprob (teacher forcing from the prefilled caches) against log p(answer | prompt) from
  one full forward over prompt + answer."""
  import jax  # noqa: PLC0415
  tok = eval_long.load_tokenizer(checkpoint, "", data_dir)
  hay = lt.Haystack.from_corpus(data_dir, tokenizer=tok)
  exs = [e for v in eval_long.make_examples(**args, haystack=hay, tokenizer=tok).values() for e in v]
  got = {(r["length"], r["depth"], r["seed"]): r["answer_logprob"] for t in res["tasks"].values()
         for r in t["examples"]}
  model, _ = inference.load_model(checkpoint)
  diffs = []
  for e in exs:
    ids = jnp.asarray(np.concatenate([e.prompt, e.answer])[None], jnp.int32)
    logits, _ = model(ids)
    lp = jax.nn.log_softmax(logits[0, e.length - 1:-1].astype(jnp.float32), axis=-1)  # [A, V]
    ref = float(jnp.take_along_axis(lp, jnp.asarray(e.answer)[:, None], axis=-1).sum())
    diffs.append(abs(got[e.length, e.depth, e.seed] - ref))
    assert diffs[-1] < LOGPROB_TOL, (e.task, e.length, e.depth, got[e.length, e.depth, e.seed], ref)


def test_eval_long_runs_on_the_hf_fixture(corpus, char_tokenizer, tmp_path):
  """The same command on an imported HF MiniMax-M3 checkpoint (MSA + MoE layers) with its own tokenizer. Its cached
  decoding against the full forward: tests/test_decode.py (logits of this fixture) and the export test above."""
  out = str(tmp_path / "eval")
  eval_long.evaluate(checkpoint=HF_MSA, tokenizer=char_tokenizer, tasks="passkey", lengths="300",
                           depths="0,1", samples=1, out=out, data_dir=corpus[0], batch_size=2, prefill_chunk=100,
                           loss_length=300, loss_bins=3)
  check_outputs(out, ["passkey"], [300], [0.0, 1.0])


def test_bad_arguments_are_errors_before_loading_anything(corpus, msa_export, tmp_path):
  out = str(tmp_path / "never")
  kw = dict(checkpoint=msa_export, tasks="passkey", lengths="256", depths="0.5", samples=1, out=out,
            data_dir=corpus[0])
  for change, match in (({"tasks": "passkey,needle"}, "--tasks.*unknown task"),
                        ({"lengths": "100,256"}, r"--lengths=100,256: 100 is below the minimum"),
                        ({"depths": "0.5,2"}, "--depths"),
                        ({"samples": 0}, "--samples"),
                        ({"checkpoint": str(tmp_path / "missing")}, "--checkpoint"),
                        ({"data_dir": str(tmp_path)}, "--data_dir")):
    with pytest.raises(ValueError, match=match):
      eval_long.evaluate(**{**kw, **change})
  assert not os.path.exists(out)
  proc = subprocess.run([sys.executable, "-m", "m3_jax.eval_long", f"--checkpoint={msa_export}", "--tasks=nope",
                         f"--out={out}", f"--data_dir={corpus[0]}"], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: --tasks='nope'")


# ---------------------------------------------------------------------------------------------------------------
# Needle selection: did the MSA selection of the answer's query hold the needle's blocks?
# ---------------------------------------------------------------------------------------------------------------


def oracle_needle_slots(e, tok):
  """The answer needle's first sentence by character offsets, not by looking for a '.' from needle_pos (how
  eval_long finds it): the tokens from needle_pos up to the one that ends "<answer>.", the anchor the prompt holds
  exactly once (so a distractor needle cannot stand in for it)."""
  text = tok.decode(e.prompt)
  ends = np.asarray([len(tok.decode(e.prompt[:i + 1])) for i in range(len(e.prompt))])  # char end of token i
  anchor = f"{e.answer_text}."
  assert text.count(anchor) == 1
  stop = text.index(anchor) + len(anchor)
  last = int(np.flatnonzero(ends >= stop)[0])
  assert ends[e.needle_pos - 1] < text.index(anchor) <= ends[last]  # the anchor lies in needle_pos..last
  return np.arange(e.needle_pos, last + 1)


def test_needle_selected_is_the_last_queries_selection_of_the_needle_blocks(corpus, msa_export, tmp_path, capsys):
  """Per example and per cell, needle_selected against its definition: the MSA layer's (layer 1) block_idx at the
  last prompt position from the model's full forward with capture_attention=True (probabilities and all, not the
  light capture eval_long runs), and numpy set membership of every needle token's block, per KV group. multi_key
  has distractor needles: the one holding the answer is the one measured.

  The export's top-2 blocks (one of them the forced local block) can never hold a needle of more than 8 tokens, so
  every value would be 0; a copy that selects 28 of the 40 blocks (same weights) makes the oracle tell examples
  apart."""
  wide = str(tmp_path / "export_top28")
  shutil.copytree(msa_export, wide)
  with open(os.path.join(wide, "model_config.json")) as f:
    model_cfg = json.load(f)
  with open(os.path.join(wide, "model_config.json"), "w") as f:
    json.dump({**model_cfg, "index_topk_blocks": 28}, f)
  res = eval_long.evaluate(checkpoint=wide, tasks="passkey,multi_key", lengths="320", depths="0,0.5,1",
                           samples=2, out=str(tmp_path / "eval"), data_dir=corpus[0], batch_size=4,
                           prefill_chunk=64, loss_length=-1)
  assert res["needle_selection"] is True
  lines = [x for x in capsys.readouterr().out.splitlines() if " accuracy " in x]
  assert len(lines) == 2 and all(", needle selected " in x for x in lines)
  tok = eval_long.load_tokenizer(wide, "", corpus[0])
  hay = lt.Haystack.from_corpus(corpus[0], tokenizer=tok)
  exs = eval_long.make_examples(["passkey", "multi_key"], [320], [0.0, 0.5, 1.0], 2, 0, hay, tok)
  model, cfg = inference.load_model(wide)
  assert cfg.index_topk_blocks == 28
  block = cfg.index_block_size
  capture = jax.jit(lambda ids: model(ids, capture_attention=True)[1]["block_idx"][1][:, :, -1])  # [B, Hkv, topk]
  seen = []
  for (task, _), part in exs.items():
    sel = np.asarray(capture(jnp.asarray(np.stack([e.prompt for e in part]))))
    rows = {(r["depth"], r["seed"]): r for r in res["tasks"][task]["examples"]}
    for e, s in zip(part, sel):
      blocks = set((oracle_needle_slots(e, tok) // block).tolist())
      want = np.mean([blocks <= set(g[g >= 0].tolist()) for g in s])  # every needle block among the group's
      r = rows[e.depth, e.seed]
      assert r["needle_selected"] == want and r["needle_selected_by_layer"] == {"1": want}, (task, e.depth)
      seen.append(want)
    for c in res["tasks"][task]["cells"]:
      mine = [rows[d, s]["needle_selected"] for d, s in rows if d == c["depth"]]
      assert c["needle_selected"] == pytest.approx(np.mean(mine))
    assert res["tasks"][task]["needle_selected"] == pytest.approx(np.mean([r["needle_selected"]
                                                                            for r in rows.values()]))
  assert min(seen) < max(seen), seen  # the oracle told examples apart: some needles were selected, some not
  with open(tmp_path / "eval" / "results.json") as f:
    assert json.load(f)["tasks"] == json.loads(json.dumps(res["tasks"]))


def test_no_needle_selected_without_msa_layers_or_when_turned_off(corpus):
  """A dense model has no selection to measure, and --needle_selection=False measures none: no example keys, None
  per cell and task (the scoring itself is untouched)."""
  from m3_jax.models import decode  # noqa: PLC0415
  from m3_jax.models.transformer import TextModel  # noqa: PLC0415
  from tests.model_utils import msa_cfg, numpy_values  # noqa: PLC0415
  _, tok, hay = corpus
  exs = eval_long.make_examples(["passkey"], [192], [0.5], 1, 0, hay, tok)
  for cfg, on in ((msa_cfg(vocab_size=512, layer_types=["full_attention"] * 2), True), (msa_cfg(vocab_size=512),
                                                                                        False)):
    model = nnx.eval_shape(lambda cfg=cfg: TextModel(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, numpy_values(state))
    res, _ = eval_long.run_tasks(model, decode.make_step(model), tok, exs, batch_size=1, max_len=200,
                                 prefill_chunk=64, t0=0.0, check=False, needle_selection=on)
    r = res["passkey"]
    assert len(r["examples"]) == 1 and not any(k.startswith("needle_selected") for k in r["examples"][0])
    assert r["needle_selected"] is None and [c["needle_selected"] for c in r["cells"]] == [None]


def test_progress_keeps_the_rows_scored_before_a_stop(corpus, tmp_path, monkeypatch):
  """run_tasks(progress=PATH) appends each (length, task)'s rows as they are scored: all of them, equal to the
  returned rows, on a finished run; only the first length's, the same rows, when the second length is stopped."""
  from m3_jax.models import decode  # noqa: PLC0415
  from m3_jax.models.transformer import TextModel  # noqa: PLC0415
  from tests.model_utils import msa_cfg, numpy_values  # noqa: PLC0415
  _, tok, hay = corpus
  exs = eval_long.make_examples(["passkey"], [192, 256], [0.0, 1.0], 1, 0, hay, tok)
  model = nnx.eval_shape(lambda: TextModel(msa_cfg(vocab_size=512, layer_types=["full_attention"] * 2),
                                           rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, numpy_values(state))
  step = decode.make_step(model)
  kw = dict(batch_size=2, max_len=300, prefill_chunk=64, t0=0.0, check=False)

  def read(path):
    with open(path) as f:
      return [json.loads(line) for line in f]

  done = str(tmp_path / "done.jsonl")
  res, _ = eval_long.run_tasks(model, step, tok, exs, progress=done, **kw)
  rows = read(done)
  assert rows == [{"task": "passkey", **r} for r in res["passkey"]["examples"]] and len(rows) == 4

  real = eval_long.greedy_answers

  def stop_at_256(model, step, prompts, **kw):
    if prompts.shape[1] == 256:
      raise KeyboardInterrupt
    return real(model, step, prompts, **kw)

  monkeypatch.setattr(eval_long, "greedy_answers", stop_at_256)
  stopped = str(tmp_path / "stopped.jsonl")
  with pytest.raises(KeyboardInterrupt):
    eval_long.run_tasks(model, step, tok, exs, progress=stopped, **kw)
  assert read(stopped) == [r for r in rows if r["length"] == 192] and len(read(stopped)) == 2


def test_selection_capture_is_capture_without_probabilities():
  """capture_attention="selection" (eval_long's light capture): the MSA selections of capture=True, no attention
  probabilities from any layer; other values are named errors."""
  from m3_jax.models.transformer import TextModel  # noqa: PLC0415
  from tests.model_utils import msa_cfg, numpy_values  # noqa: PLC0415
  model = nnx.eval_shape(lambda: TextModel(msa_cfg(), rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, numpy_values(state))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 101, (2, 24)), jnp.int32)
  _, full = model(ids, capture_attention=True)
  _, light = model(ids, capture_attention="selection")
  assert "attention_probs" not in light and light["block_idx"][0] is None
  np.testing.assert_array_equal(light["block_idx"][1], full["block_idx"][1])
  with pytest.raises(ValueError, match="capture_attention='probs'"):
    model(ids, capture_attention="probs")
