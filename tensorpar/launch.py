"""Start a job's process group so that it survives ``torchrun``'s restarts.

``torchrun --max-restarts N`` starts every worker again after one fails, against the same
rendezvous store. The default group's keys from the failed attempt (each rank's gloo
address) are still in that store, and with gloo on torch 2.13 the restarted workers read
them and fail to connect to the dead workers ("Gloo connectFullMesh failed ... Connection
refused"). `init_distributed` keys the group under the attempt's number
(``TORCHELASTIC_RESTART_COUNT``), so each attempt meets only its own workers.

That number is counted per machine by torch 2.13's agents (only the machine whose worker
failed counts the restart): on several machines the restarted workers carry different
numbers and do not meet. A multi-machine job is restarted whole (see the training-loop docs).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]
from torch.distributed.rendezvous import rendezvous

__all__ = ["init_distributed"]


def init_distributed(backend: str | None = None, *,
                     timeout: datetime.timedelta | None = None) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    Picks NCCL and ``cuda:LOCAL_RANK`` where CUDA is available, gloo and the CPU otherwise
    (or ``backend`` as given). The group's store is the ``env://`` rendezvous store prefixed
    by the restart count, so the same script is the first attempt of a job and every
    restart of it (``torchrun --max-restarts N``); pair it with a resume from the newest
    checkpoint (see the training-loop docs) and a killed worker costs only the steps since
    the last save.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...; ``None`` picks by device as above.
        timeout: the process group's timeout for collectives; ``None`` keeps torch's default.

    Returns:
        The device this rank should compute on (``cuda:LOCAL_RANK`` or ``cpu``).

    Raises:
        RuntimeError: the default group is already initialised, or torchrun's environment
            (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) is missing.
        ValueError: ``RANK``, ``WORLD_SIZE`` or ``TORCHELASTIC_RESTART_COUNT`` is not an
            integer, or ``RANK`` is not in ``[0, WORLD_SIZE)`` (refused before the
            rendezvous, which would wait for its timeout).
    """
    if dist.is_initialized():
        raise RuntimeError("init_distributed: the default process group is already "
                           "initialised; expected one call at the start of the job")
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed: environment variables {missing} are not set; "
                           f"expected a job launched by torchrun (or with those set by hand)")
    rank, world_size, attempt = (_integer(name) for name in
                                 ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"))
    if world_size < 1 or not 0 <= rank < world_size or attempt < 0:
        raise ValueError(f"init_distributed: RANK={rank} is not below WORLD_SIZE={world_size} "
                         f"(or one of them, or TORCHELASTIC_RESTART_COUNT={attempt}, is "
                         f"negative); expected 0 <= RANK < WORLD_SIZE")
    device = torch.device("cpu")
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ and backend in (None, "nccl"):
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    found = rendezvous("env://") if timeout is None else rendezvous("env://", timeout=timeout)
    store, rank, world_size = next(found)
    dist.init_process_group(backend, store=PrefixStore(f"tensorpar/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    return device


def _integer(name: str) -> int:
    """The environment variable ``name`` as an int (``TORCHELASTIC_RESTART_COUNT``: 0 unset)."""
    text = os.environ.get(name, "0")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"init_distributed: {name}={text!r} is not an integer") from None
