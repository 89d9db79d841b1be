"""Domain parallelism: a field or volume split over ranks, halo exchanges for its stencils.

- `halo_exchange`: a tile grows by its neighbours' rows (uneven, narrow and empty tiles,
  periodic ends); the backward adds each halo row's gradient back to its owner.
- `parallelize_domain`: converts a dense convolutional model in place; each rank runs it on
  its tile of the input and gets its tile of the output.
- `domain_layout`: the tile sizes the last forward recorded.
- `domain_mean`: the mean of a split field over the whole domain (a loss), on every rank.
- `fully_shard_domain`: FSDP2 over the replicas beside the domain (a 2-D mesh).
"""

from tensorpar.domain.fsdp import fully_shard_domain
from tensorpar.domain.halo import halo_exchange
from tensorpar.domain.loss import domain_mean
from tensorpar.domain.parallelize import domain_layout, parallelize_domain

__all__ = ["domain_layout", "domain_mean", "fully_shard_domain", "halo_exchange",
           "parallelize_domain"]
