"""Shared, correctness-critical training mechanics for the recipes (a toolbox, not a framework)."""
