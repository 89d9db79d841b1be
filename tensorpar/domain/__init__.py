"""Domain parallelism: a field or volume split over ranks, halo exchanges for its stencils."""

from tensorpar.domain.halo import halo_exchange

__all__ = ["halo_exchange"]
