"""Model bodies built from core layers."""
