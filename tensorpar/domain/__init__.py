"""Domain parallelism: a field or volume split over ranks, halo exchanges for its stencils.

- `halo_exchange`: a tile grows by its neighbours' rows (uneven, narrow and empty tiles,
  periodic ends); the backward adds each halo row's gradient back to its owner.
- `parallelize_domain`: converts a dense convolutional model in place; each rank runs it on
  its tile of the input and gets its tile of the output.
- `domain_layout`: the tile sizes the last forward recorded.
"""

from tensorpar.domain.halo import halo_exchange
from tensorpar.domain.parallelize import domain_layout, parallelize_domain

__all__ = ["domain_layout", "halo_exchange", "parallelize_domain"]
