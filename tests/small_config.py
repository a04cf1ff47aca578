"""Config file for subprocess training tests: `--config=tests/small_config.py:DATA_DIR`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_utils import small_config  # noqa: E402


def get_config(arg):
  """arg: the data directory (the calling test's tmp dir)."""
  if not arg:
    raise ValueError("tests/small_config.py needs the data directory: --config=tests/small_config.py:DATA_DIR")
  return small_config(arg)
