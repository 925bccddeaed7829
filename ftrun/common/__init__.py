"""What every ftrun process shares: the wire protocol and codec, the rank contract, events, checkpoints on disk."""
