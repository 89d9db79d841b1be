"""The traceable path: what the collectives and layers run while ``torch.compile`` traces.

The eager path stays where it is (`tensorpar.collectives.functional`,
`tensorpar.collectives.regions`, the layers):
each public entry point checks ``torch.compiler.is_compiling()`` once and hands over to the
functions here, which build the same computation from PyTorch's functional collectives so
that dynamo records it in one graph, forward and backward.
"""
