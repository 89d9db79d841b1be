"""The group layer.

Process groups resolved at call time, the raw calls to torch.distributed, fault translation, and
the mode switches (validation, compiling).
"""
