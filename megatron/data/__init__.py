"""Data pipeline: mmap indexed datasets and the datasets built on them."""
