"""Plans.

The style classes (configuration as data), their matching and checks, and the converter that
applies them.
"""
