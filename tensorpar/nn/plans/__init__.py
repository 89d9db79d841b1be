"""Plans.

The style classes (configuration as data), their matching and checks. The converter that
applies them is `tensorpar.nn.convert`.
"""
