"""Kernels: Triton kernels and the torch references they are tested against."""
