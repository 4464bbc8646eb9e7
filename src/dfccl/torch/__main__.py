"""``python -m dfccl.torch``: builds the compiled backend for the torch in
use (if it is not built yet) and says which backend ``"dfccl"`` makes and
where the build lives."""

import torch

import dfccl.torch as dt

print(f"dfccl.torch: {dt.implementation()} backend, torch {torch.__version__}, build {dt.build_dir()}")
