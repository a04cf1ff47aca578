"""m3_jax: MiniMax-M3 (MSA, 3D ViT, native multimodal) in JAX/Flax NNX with Pallas kernels.

Ranges here say what the code is written against; `requirements.lock` pins the exact versions the GPU box runs.
"""
from setuptools import find_packages, setup

setup(
    name="m3_jax",
    version="0.1.0",
    python_requires=">=3.12",
    packages=find_packages(include=["m3_jax", "m3_jax.*", "pallas_kernels", "pallas_kernels.*"]),
    install_requires=[
        "jax>=0.11.2,<0.13",
        "flax>=0.12.10,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.4,<0.13",
        "grain>=0.2.18,<0.3",
        "ml-collections>=1.1,<2",
        "numpy>=2.0",
        "absl-py",
        "tokenizers>=0.22,<0.24",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "pillow>=10",
    ],
    extras_require={"test": ["pytest"]},
)
