"""The package version (``setup.cfg`` reads it; checkpoints record it)."""

__version__ = "0.1.0"
