"""Same export, same length: answer NLL on TaskRows-format examples vs eval_long prompts, averaged the same way."""
import sys, numpy as np, jax, jax.numpy as jnp
from m3_jax.data import long_tasks as lt
from m3_jax.data.common import seed32
from m3_jax.data.text_prepare import load_tokenizer
from m3_jax.inference import load_model
exp, L, n = sys.argv[1], int(sys.argv[2]), 40
tok = load_tokenizer(".gpudata"); model, cfg = load_model(exp, None)
hay = lt.Haystack.from_corpus(".gpudata", tokenizer=tok)
def score(prompt, answer):
  full = jnp.asarray(np.concatenate([prompt, answer])[None])
  lp = jax.nn.log_softmax(model(full[:, :-1])[0][0], -1)
  idx = np.arange(len(prompt) - 1, len(prompt) - 1 + len(answer))
  return -np.asarray(lp[idx, np.asarray(answer)])
rng = np.random.default_rng(0)
for name, row, depth in [("row=True, random depth", True, None), ("row=False, random depth", False, None),
                         ("row=False, eval depths", False, "grid")]:
  per, tokw, first = [], [], []
  for i in range(n):
    d = float(rng.random()) if depth is None else [0, .25, .5, .75, 1][i % 5]
    e = lt.make_example("passkey", haystack=hay, tokenizer=tok, length=L + (1 if row else 0), depth=d,
                        seed=seed32(7, i), row=row)
    t = score(e.prompt, e.answer); per.append(t.mean()); tokw += list(t); first.append(t[0])
  print(f"{name}: per-example mean {np.mean(per):.2f}, token-weighted {np.mean(tokw):.2f}, first token {np.mean(first):.2f}")
# the same row=True examples with the prompt shifted by k tokens (a haystack token after the intro dropped or
# duplicated): if NLL jumps, the model reads the answer's token count off the prompt's length
for k in (-1, +1):
  per = []
  for i in range(n):
    e = lt.make_example("passkey", haystack=hay, tokenizer=tok, length=L + 1, depth=float(rng.random()),
                        seed=seed32(7, i), row=True)
    p = np.delete(e.prompt, 20) if k < 0 else np.insert(e.prompt, 20, e.prompt[20])
    per.append(score(p, e.answer).mean())
  print(f"row=True, prompt {k:+d} token: per-example mean {np.mean(per):.2f}")
by_n = {}
for i in range(n):
  e = lt.make_example("passkey", haystack=hay, tokenizer=tok, length=L + 1, depth=0.5, seed=seed32(9, i), row=True)
  by_n.setdefault(len(e.answer), []).append(len(e.prompt))
print("row=True: answer tokens -> prompt lengths", {k: sorted(set(v)) for k, v in sorted(by_n.items())})
