"""transformers adapters.

Plans derived from a model's tp_plan, latent attention, experts and sequence parallelism for its
architectures.
"""
