"""Asynchronous GRPO, as in INTELLECT-2."""
