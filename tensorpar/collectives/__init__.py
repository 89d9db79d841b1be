"""Collectives.

The functional API and region mappings, their autograd Functions, and the eager and traced data
paths.
"""
