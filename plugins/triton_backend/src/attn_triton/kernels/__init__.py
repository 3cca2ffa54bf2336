"""Triton kernels of the backend (importing these modules imports torch and triton)."""
