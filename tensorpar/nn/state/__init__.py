"""Parameter state.

Tags, sharded and full checkpoints, optimizer state, gradient clipping, partial gradients,
replica checks.
"""
