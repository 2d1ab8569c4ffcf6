"""Bundled research tasks: each declares a typed search space, a metric and a training entry point."""
