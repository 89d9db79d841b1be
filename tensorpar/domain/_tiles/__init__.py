"""The split domain itself: how the tiles' rows move, and what every rank agrees on.

Row plans and exchanges (`rows`, `overlap`), the layout one forward records (`layout`),
the marks that tell tiles from pooled features (`marks`), the ranks' small agreements on
decisions read from a tile (`agree`) and sums and extremes over the whole domain
(`sums`). Nothing here imports the converted layers or the functional-call conversion
above it.
"""
