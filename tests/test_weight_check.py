"""parallelize's weight check: exact (one bit, a permutation), and bounded in memory."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorpar.errors import CollectiveArgumentError
from tensorpar.testing import run_distributed
from tensorpar.validation._replica import check_same_weights

TIMEOUT = 60.0


def _swap(flat, i, j):
    flat[i], flat[j] = flat[j].clone(), flat[i].clone()


def _changed_on_rank_1(change, dtype):
    """Every rank builds the same model; rank 1 changes one tensor in a way ``change`` names."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 96), nn.Linear(96, 8)).to(dtype)
    weight = model[0].weight.data
    if dist.get_rank() == 1 and change != "none":
        words = weight.view(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        if change == "bit":  # the lowest bit of one element
            words[12345] ^= 1
        else:  # swap two units 65521 apart: the period of the former positional weights
            unit = words.view(torch.uint8) if dtype == torch.bfloat16 else words
            k = next(k for k in range(100) if unit[k] != unit[k + 65521])
            _swap(unit, k, k + 65521)
    try:
        check_same_weights("parallelize", model, None)
    except CollectiveArgumentError as e:
        return str(e)
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("change", ["bit", "permutation"])
def test_a_one_bit_difference_and_a_permutation_raise_on_every_rank(change, dtype):
    got = run_distributed(_changed_on_rank_1, 2, change, dtype, timeout=TIMEOUT)
    for message in got:
        assert message is not None, got
        assert "'0.weight' (tensor #0) differs in values: rank 0 version 1, rank 1 version 2" \
            in message, message


def test_the_same_weights_pass():
    assert run_distributed(_changed_on_rank_1, 2, "none", torch.bfloat16,
                           timeout=TIMEOUT) == [None, None]


_PEAK = textwrap.dedent("""
    import torch
    from tensorpar.validation._replica import _fingerprints

    def rss(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

    t = torch.randn({numel}).to(torch.bfloat16)
    strided = torch.randn(64, {numel} // 64).to(torch.bfloat16).t()  # not contiguous
    _fingerprints([("warm-up", t[:100])])
    for x in (t, strided):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident set
        base = rss("VmRSS:")
        _fingerprints([("w", x)])
        print(rss("VmHWM:") - base)
""")


@pytest.mark.slow
def test_the_check_needs_no_memory_in_proportion_to_the_tensor():
    numel = 16 << 20  # 32 MiB of bfloat16 (the former check took 24x that on top)
    out = subprocess.run([sys.executable, "-c", _PEAK.format(numel=numel)], check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    contiguous, strided = (int(v) for v in out)
    # a few segments (SEGMENT_BYTES, 1 MiB) in flight at most, plus the threads' arenas
    assert contiguous < 16 << 20 and strided < 16 << 20, (contiguous, strided)
