"""Long-context tasks and their evaluation: the task generators' contract (exact lengths, the answer once, at the
requested depth, deterministic), task rows in the training pipeline, and `python -m m3_jax.eval_long` end to end
on an exported MSA model and an HF fixture, whose cached decoding must give the full forward's greedy tokens."""

import numpy as np
import pytest

from m3_jax.core.batch import EOT, TEXT_KEYS
from m3_jax.data import long_tasks as lt
from m3_jax.data import text_pipeline, text_prepare
from tests.train_utils import license_texts

LENGTH = 400
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A prepared corpus of licence texts (vocab 512), its tokenizer and the held-out haystack."""
  d = str(tmp_path_factory.mktemp("long_data"))
  text_prepare.prepare(d, sources=(), text_files={"licenses": license_texts()}, vocab_size=512, verbose=False)
  tok = text_prepare.load_tokenizer(d)
  return d, tok, lt.Haystack.from_corpus(d, tokenizer=tok)


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
    assert m[-1] and b["targets"][i, -1] == EOT and (b["segment_ids"][i] == 1).all()
    answer = tok.decode(b["targets"][i][m][:-1])
    first = int(np.argmax(m))
    question = tok.decode(b["inputs"][i][:first + 1])
    assert question.rstrip().endswith((" is", " are")) and answer.startswith(" ")
    assert question.count(answer.strip().split(", ")[0]) >= 1  # the answer is in the context
