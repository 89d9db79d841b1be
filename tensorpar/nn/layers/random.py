"""Random streams for dropout inside tensor-parallel regions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tensorpar.comm._group import GroupLike, resolve_group

__all__ = ["ParallelRNG", "rng_kept"]


class ParallelRNG:
    """Two random streams for a tensor-parallel group, kept apart from torch's global one.

    - `replicated`: the same stream on every rank of the group. Use it for dropout on
      activations that every rank holds in full (after a row-parallel layer), so the ranks
      keep identical activations.
    - `sharded`: a different stream on every rank. Use it for dropout on activations
      that are split across the group (after a column-parallel layer), so the slices do not
      all draw the same mask.

    Each stream advances across uses and is restored around each ``with`` block; the global
    RNG is left as it was. Ranks of *different* tensor-parallel groups (e.g. data-parallel
    replicas) should pass different seeds if they must draw different masks.

    Args:
        seed: the base seed.
        group: the tensor-parallel group.

    Example:
        >>> import torch
        >>> from tensorpar.nn import ParallelRNG
        >>> rng = ParallelRNG(seed=1234)
        >>> with rng.replicated():
        ...     mask = torch.nn.functional.dropout(torch.ones(4), p=0.5)
    """

    def __init__(self, seed: int, *, group: GroupLike = None) -> None:
        g = resolve_group(group, "ParallelRNG")
        self._states = {"replicated": self._seeded(seed),
                        "sharded": self._seeded(seed + 1 + 7919 * (g.rank + 1))}

    @staticmethod
    def _seeded(seed: int) -> dict[str, torch.Tensor]:
        with torch.random.fork_rng(devices=_cuda_devices()):
            torch.manual_seed(seed)
            return _capture()

    @contextlib.contextmanager
    def replicated(self) -> Iterator[None]:
        """Draw from the stream that is the same on every rank of the group."""
        with self._use("replicated"):
            yield

    @contextlib.contextmanager
    def sharded(self) -> Iterator[None]:
        """Draw from this rank's own stream."""
        with self._use("sharded"):
            yield

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Both streams' states on this rank, for a checkpoint (`load_state_dict` resumes them).

        Keys ``"replicated.cpu"`` and ``"sharded.cpu"`` (and ``".cuda"`` ones on a GPU). The
        sharded stream differs between ranks: saved with ``torch.distributed.checkpoint``,
        a tensor every rank saves under the same name is kept once (one rank's would come
        back on every rank), so save each rank's under a name of its own, or every rank's
        stacked (as ``examples/train_lm.py`` saves torch's RNG states).
        """
        return {f"{name}.{device}": t.clone() for name, state in self._states.items()
                for device, t in state.items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Resume both streams from a `state_dict` of this rank's.

        Raises:
            ValueError: ``state_dict`` lacks a stream's state or has keys of none.
        """
        want = set(self.state_dict())
        if set(state_dict) != want:
            raise ValueError(f"ParallelRNG.load_state_dict: expected the keys "
                             f"{sorted(want)}, got {sorted(state_dict)}")
        for name, state in self._states.items():
            for device in state:
                # (a copy: torch.set_rng_state crashed on a view at an offset)
                state[device] = state_dict[f"{name}.{device}"].detach().to("cpu").clone()

    @contextlib.contextmanager
    def _use(self, name: str) -> Iterator[None]:
        with torch.random.fork_rng(devices=_cuda_devices()):
            _restore(self._states[name])
            try:
                yield
            finally:
                self._states[name] = _capture()


@contextlib.contextmanager
def rng_kept(device: torch.device | str | None = None) -> Iterator[None]:
    """Torch's global random stream as it was before the block: the CPU's, and ``device``'s.

    A layer built to take a dense layer's values (``from_dense``) initialises its parameters
    first; that draw would move the stream by the shard's size, which differs between
    ranks, and a batch or a dropout mask drawn afterwards would differ between the ranks
    and from the dense model's.
    """
    where = torch.device(device) if device is not None else None
    gpus = [where.index if where.index is not None else torch.cuda.current_device()] \
        if where is not None and where.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        yield


def _cuda_devices() -> list[int]:
    """The device whose stream the streams hold: the current one (as `_capture` reads).

    Forking every GPU's stream would make a CUDA context on each GPU of the machine in
    every process.
    """
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def _capture() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
