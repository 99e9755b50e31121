"""Tasks: a model with its loss, metrics and training settings."""
