"""A converted model's functional calls followed while its forward runs (`calls`).

Which dims hold the split points (`points`), reductions over them (`reductions`), pooled
features meeting the tiles (`meet`, `flow`), the parameters' shares (`shares`). Built on
`_layers` and `_tiles`.
"""
