"""Benchmarks (top of the import graph; nothing imports them)."""
