"""Prefill + decode with caches reproduce the full forward pass; greedy generation matches HF transformers."""

import os

import numpy as np
import pytest
import jax.numpy as jnp

from m3_jax.interop import hf
from m3_jax.models import decode

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


@pytest.mark.parametrize("name", ["text_dense", "text_msa"])
def test_chunked_prefill_and_decode_equal_full_forward(name):
  model, cfg = hf.load(os.path.join(FIX, name))
  ids = jnp.asarray(np.load(os.path.join(FIX, name, "reference.npz"))["input_ids"])[:, :40]
  full, _ = model(ids)
  step = decode.make_step(model)
  caches = decode.init_caches(model, ids.shape[0], 48)
  pieces = []
  for lo, hi in ((0, 17), (17, 25)):  # chunked prefill: two chunks of different lengths
    logits, caches = step(ids[:, lo:hi], caches)
    pieces.append(logits)
  for t in range(25, 40):  # then token by token
    logits, caches = step(ids[:, t:t + 1], caches)
    pieces.append(logits)
  got = jnp.concatenate(pieces, axis=1)
  np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=2e-5, rtol=0)
  assert int(caches[0].length) == 40


@pytest.mark.parametrize("name", ["text_dense", "text_msa"])
def test_greedy_generation_matches_hf(name):
  r = np.load(os.path.join(FIX, name, "reference.npz"))
  model, _ = hf.load(os.path.join(FIX, name))
  prompt = jnp.asarray(r["gen_prompt_ids"])
  new = r["gen_new_ids"]
  got = decode.generate(model, prompt, max_new_tokens=new.shape[1])
  np.testing.assert_array_equal(np.asarray(got), new)
