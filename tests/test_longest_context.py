"""experiments/longest_context.py's line fit, prediction and --run_from bookkeeping (closed-form values)."""

import json

import pytest

from experiments import longest_context as lc

GIB = 2**30


def test_fit_line_and_predict_the_longest_multiple_of_the_granule():
  # 1 KiB per token on top of 2 GiB fixed
  slope, intercept = lc.fit_line([(262144, 2 * GIB + 262144 * 1024), (131072, 2 * GIB + 131072 * 1024)])
  assert slope == pytest.approx(1024) and intercept == pytest.approx(2 * GIB)
  # (10 GiB - 2 GiB) / 1 KiB = 8,388,608 tokens, a multiple of 16384 already; one byte less drops a granule
  assert lc.predict(slope, intercept, 10 * GIB, 16384) == 8 * 2**20
  assert lc.predict(slope, intercept, 10 * GIB - 1, 16384) == 8 * 2**20 - 16384
  assert lc.predict(slope, intercept, GIB, 16384) == 0  # the fixed part alone is over the limit
  with pytest.raises(ValueError, match="two different lengths"):
    lc.fit_line([(4096, 1.0), (4096, 2.0)])
  with pytest.raises(ValueError, match="does not grow"):
    lc.predict(0.0, 0.0, GIB, 16384)


def test_run_from_trains_each_fitted_variant_at_its_longest_length(tmp_path, monkeypatch):
  fits = [{"config_arg": "attention=msa,heads=8/2", "longest_seq_len": 65536,
           "chunked_config_arg": "attention=msa,heads=8/2,loss_chunk=4096", "chunked_longest_seq_len": 98304},
          {"config_arg": "attention=dense,heads=8/2", "longest_seq_len": None}]
  (tmp_path / "a.json").write_text(json.dumps({"info": {"device": "x"}, "variants": fits}))
  calls = []
  monkeypatch.setattr(lc, "train_at", lambda arg, seq, args: calls.append((arg, seq)) or {"returncode": 0})
  args = lc.ap.parse_args([f"--run_from={tmp_path / 'a.json'}", f"--out={tmp_path / 'out.json'}"])
  lc.run_from(args)
  # the loss-chunked fit is the longer one and is what runs; a variant with no fitting length is skipped
  assert calls == [("attention=msa,heads=8/2,loss_chunk=4096", 98304)]
  out = json.loads((tmp_path / "out.json").read_text())
  assert out["variants"][0]["chunked_run"] == {"returncode": 0} and "run" not in out["variants"][1]
