"""Command-line tools around the recipes (corpus builders, plots)."""
