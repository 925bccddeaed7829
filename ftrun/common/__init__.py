"""What every ftrun process shares: the wire protocol and codec, the rank contract, events, checkpoints on disk."""

__version__ = "0.1.0"  # ftrun's version (pyproject.toml says the same; checkpoints record it)
