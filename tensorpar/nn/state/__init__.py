"""Parameter state.

Shard arithmetic (who holds which slice of a dim), tags, sharded and full checkpoints,
optimizer state, gradient clipping, partial gradients, replica checks.
"""
