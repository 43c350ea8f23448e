"""Helpers for tests, demos and benchmarks (need the ``test`` extra); the engine never
imports them."""
