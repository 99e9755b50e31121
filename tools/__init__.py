"""Command-line binaries."""
