"""SimulatedCluster: a real 2 x 2 cluster of network namespaces runs the hierarchical check.

These tests need root (network namespaces); CI runs as root. Elsewhere they skip.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tensorpar.errors import ClusterError
from tensorpar.testing.cluster import SimulatedCluster

JOB = Path(__file__).with_name("_cluster_job.py")
REDUCER_JOB = Path(__file__).with_name("_cluster_reducer_job.py")

pytestmark = pytest.mark.slow  # namespaces, rate-limited links and whole jobs

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="a simulated cluster needs root and iproute2 (ip, tc) to create network namespaces")


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_root
@pytest.mark.timeout(240)
def test_reducer_with_the_hierarchical_algorithm_equals_ddp_across_simulated_machines():
    before = _namespaces()
    with SimulatedCluster(machines=2, ranks_per_machine=2, link="1gbit") as cluster:
        result = cluster.run(REDUCER_JOB, timeout=200)
    assert _namespaces() == before
    result.check()
    found = re.findall(r"OK rank (\d+) buckets (\d+) grad_gap (\S+) weight_gap (\S+) "
                       r"inter_bytes (\d+) scatters (\d+)",
                       "".join(m.output for m in result.machines))
    assert sorted(hit[0] for hit in found) == ["0", "1", "2", "3"], found
    for _, buckets, grad_gap, weight_gap, inter, scatters in found:
        assert int(buckets) > 1 and int(scatters) > 0, found  # several buckets, 2-D each
        assert float(grad_gap) < 1e-12 and float(weight_gap) < 1e-12, found  # DDP's results
        assert int(inter) > 0, found  # and the rails carried bytes across the machines


@needs_root
@pytest.mark.timeout(240)
def test_hierarchical_equals_flat_across_simulated_machines():
    before = _namespaces()
    with SimulatedCluster(machines=2, ranks_per_machine=2, link="1gbit") as cluster:
        assert set(cluster.namespaces) <= _namespaces()
        result = cluster.run(JOB, timeout=200)
    assert _namespaces() == before  # everything removed
    result.check()
    # ranks of one machine share its output, and their lines may run into each other
    found = [hit for m in result.machines
             for hit in re.findall(r"OK rank (\d+) machine \d+ sent_ratio ([0-9.]+\d)", m.output)]
    assert sorted(rank for rank, _ in found) == ["0", "1", "2", "3"], found
    # the hierarchical algorithm sends 2/3 of what the flat ring sends over each link
    ratios = [float(ratio) for _, ratio in found]
    assert all(0.6 < r < 0.72 for r in ratios), ratios
    for m in result.machines:  # the link carried the traffic between machines, both ways
        assert m.tx_bytes > 4 * 2**20 and m.rx_bytes > 4 * 2**20, m
        assert m.loopback_bytes > 2**20, m  # and ranks on one machine talked over loopback


@needs_root
@pytest.mark.timeout(120)
def test_failure_and_cleanup(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['GROUP_RANK'] == '1' else 0)\n")
    before = _namespaces()
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    with SimulatedCluster(machines=3, ranks_per_machine=1, link=None) as cluster:
        result = cluster.run(script, timeout=100, grace=1.0)
        with pytest.raises(ClusterError, match="did not finish within timeout=2"):
            cluster.run(hang, timeout=2)
    assert _namespaces() == before
    assert result.machines[1].returncode == 1 and not result.ok  # torchrun's status on failure
    with pytest.raises(ClusterError, match="machine 1 exited with status 1"):
        result.check()


def test_argument_errors():
    with pytest.raises(ValueError, match="link='fast' is not a rate"):
        SimulatedCluster(link="fast")
    with pytest.raises(ValueError, match=r"machines must be in \[1, 250\], got 0"):
        SimulatedCluster(machines=0)
    with pytest.raises(TypeError, match="ranks_per_machine must be an int, got str"):
        SimulatedCluster(ranks_per_machine="2")
    with pytest.raises(ClusterError, match="not open"):
        SimulatedCluster().run("x.py")
