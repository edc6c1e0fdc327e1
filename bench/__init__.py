"""Benchmarks, load generation, experiments and reports."""
