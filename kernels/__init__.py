"""Compute backends of sdm_cupy: the Numba CPU backend (cpu) and the CUDA C++ kernels (gpu)."""
