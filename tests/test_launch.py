"""init_distributed: each torchrun attempt meets only its own workers in the shared store."""

import os
import re
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

import tensorpar

WORKER = """
import os, time
import torch, torch.distributed as dist, tensorpar
time.sleep(float(os.environ["START_DELAY"]))
device = tensorpar.init_distributed()
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
print(device.type, dist.get_backend(), dist.get_world_size(), int(x.item()), flush=True)
dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attempt(port, attempt, world=2):
    """``world`` workers as torchrun starts them: clients of the agent's store. Rank 0
    starts 3 s late, so the others look for it while the last attempt's keys are there."""
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": str(attempt), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER],
                              env={**env, "RANK": str(r), "START_DELAY": "3" if r == 0 else "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"attempt {attempt} did not finish within 60 s")
        assert p.returncode == 0, err[-2000:]
        outs.append(out.strip())
    return outs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_second_attempt_on_the_same_store_starts_its_own_group():
    port = _free_port()
    _agent = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))  # lives across attempts, as torchrun's
    for attempt in (0, 1):
        assert _attempt(port, attempt) == ["cpu gloo 2 3"] * 2


def test_outside_torchrun_the_missing_variables_are_named(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"init_distributed: environment variables \['RANK', "
                                           r"'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        tensorpar.init_distributed()


@pytest.mark.parametrize(("rank", "world", "words"), [
    ("2", "2", "RANK=2 is not below WORLD_SIZE=2"),
    ("-1", "2", "RANK=-1 is not below WORLD_SIZE=2"),
    ("0", "0", "WORLD_SIZE=0"),
    ("one", "2", "RANK='one'"),
    ("0", "x", "WORLD_SIZE='x'"),
    ("0", "2", "TORCHELASTIC_RESTART_COUNT='x'"),
])
def test_a_malformed_environment_is_refused_before_the_rendezvous(monkeypatch, rank, world,
                                                                   words):
    """Before, RANK=2 of WORLD_SIZE=2 waited for the rendezvous's timeout (30 minutes by
    default), then failed with a socket timeout."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x" if "RESTART" in words else "0")
    with pytest.raises(ValueError, match=re.escape(words)):
        tensorpar.init_distributed(timeout=timedelta(seconds=2))
