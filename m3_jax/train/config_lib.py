"""From the ml_collections experiment config to the typed pieces the code takes, with checks before compilation."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from m3_jax.models.config import TextConfig, VLConfig, VisionConfig
from m3_jax.train.optimizer import OptimConfig

# The config sections that describe the model: a checkpoint restores iff they give the same parameter shapes.
MODEL_SECTIONS = ("model", "vision", "vl")


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style `get_config(arg)` argument: "variant=moe,steps=100,runlocal" -> ConfigDict.

  A bare word sets a boolean flag. Values are typed by their default; unknown keys are an error.
  """
  out = dict(defaults)
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, eq, value = item.partition("=")
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is unknown; known: {sorted(defaults)}")
    d = defaults[key]
    if not eq:
      out[key] = True
    elif isinstance(d, bool):
      out[key] = value.lower() in ("1", "true", "yes", "on")
    elif isinstance(d, int):
      out[key] = int(value)
    elif isinstance(d, float):
      out[key] = float(value)
    else:
      out[key] = value
  return ml_collections.ConfigDict(out)


def is_multimodal(config: ml_collections.ConfigDict | dict) -> bool:
  """The one switch between the text and the vision-language model: a config with a `vision` section is VL."""
  return "vision" in config


def model_config(config: ml_collections.ConfigDict | dict, *, known_only: bool = False) -> TextConfig | VLConfig:
  """TextConfig for a text config; VLConfig (text tower = `model`, tower = `vision`, the rest = `vl`) for a config
  with a `vision` section. Takes the ConfigDict or its JSON form (a saved run config); known_only drops fields
  this code no longer has (an old checkpoint's config)."""

  def section(name, cls):
    d = config[name]
    d = dict(d.to_dict() if isinstance(d, ml_collections.ConfigDict) else d)
    if known_only:
      fields = {f.name for f in dataclasses.fields(cls)}
      d = {k: v for k, v in d.items() if k in fields}
    return cls.from_dict(d)

  text = section("model", TextConfig)
  if not is_multimodal(config):
    return text
  vl = config["vl"] if "vl" in config else {}
  vl = dict(vl.to_dict() if isinstance(vl, ml_collections.ConfigDict) else vl)
  return VLConfig(text=text, vision=section("vision", VisionConfig), **vl)


def model_config_from_export(d: dict[str, Any]) -> TextConfig | VLConfig:
  """The model config an export wrote (`cfg.to_dict()`): VLConfig's has `text` and `vision`."""
  return VLConfig.from_dict(d) if "vision" in d else TextConfig.from_dict(d)


def text_config(cfg: TextConfig | VLConfig) -> TextConfig:
  return cfg.text if isinstance(cfg, VLConfig) else cfg


def vision_config(cfg: TextConfig | VLConfig) -> VisionConfig | None:
  """The vision tower's config (what the data pipeline shapes pixels for); None for a text model."""
  return cfg.vision if isinstance(cfg, VLConfig) else None


def optim_config(config: ml_collections.ConfigDict) -> OptimConfig:
  d = dict(config.optim.to_dict())
  d.setdefault("total_steps", config.train.steps)
  # A short run of a long config (`--config.train.steps=20`) should still work: warmup never exceeds the run.
  d["warmup_steps"] = min(int(d["warmup_steps"]), int(d["total_steps"]))
  return OptimConfig(**d)


def check_train_config(config: ml_collections.ConfigDict) -> None:
  """The cheap checks a user deserves before minutes of compilation."""
  t = config.train
  for key in ("steps", "batch_size", "seq_len"):
    if int(t[key]) <= 0:
      raise ValueError(f"train.{key}={t[key]} must be positive")
  if t.seq_len < 2:
    raise ValueError(f"train.seq_len={t.seq_len} must be >= 2")
  spike = float(t.get("loss_spike", 0.0) or 0.0)
  if spike != 0.0 and spike <= 1.0:
    raise ValueError(f"train.loss_spike={spike:g} must be 0 (off) or > 1 (a multiple of the lowest loss so far)")
  if int(config.checkpoint.every) < 0:
    raise ValueError(f"checkpoint.every={config.checkpoint.every} must be >= 0 (0 disables periodic saves)")
  profile_steps(config)


def profile_steps(config: ml_collections.ConfigDict) -> tuple[int, int] | None:
  """train.profile_steps "FIRST,LAST" -> (FIRST, LAST), 1-based and inclusive; None when empty."""
  spec = str(config.train.get("profile_steps", "") or "").strip()
  if not spec:
    return None
  first, _, last = spec.partition(",")
  try:
    first_i, last_i = int(first), int(last or first)
  except ValueError:
    raise ValueError(f"train.profile_steps={spec!r} is not FIRST,LAST (two step numbers)") from None
  if not 1 <= first_i <= last_i:
    raise ValueError(f"train.profile_steps={spec!r}: need 1 <= FIRST <= LAST")
  return first_i, last_i


def to_jsonable(config: ml_collections.ConfigDict) -> dict[str, Any]:
  def conv(x):
    if isinstance(x, dict):
      return {k: conv(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [conv(v) for v in x]
    return x
  return conv(config.to_dict())
