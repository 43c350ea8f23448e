"""Integrations of the engine into serving stacks."""
