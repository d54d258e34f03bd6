"""CUDA-graph runner for the SDM op on CuPy stream capture (SPEC §8). Under construction."""
