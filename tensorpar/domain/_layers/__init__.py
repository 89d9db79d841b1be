"""The converted layers' forwards on a tile, built on `_tiles`.

Windows (convolutions and poolings), norms, resampling, pixel shuffles, pads, attention
blocks and neural-operator spectral layers.
"""
