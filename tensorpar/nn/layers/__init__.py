"""Model-parallel layers.

Column/row-parallel linear and Conv1D, vocab-parallel embedding and cross entropy,
scatter/gather modules.
"""
