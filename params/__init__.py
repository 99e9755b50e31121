"""Model param files; each registers named model configurations."""
