"""The same script at thousands of ranks: what each per-job mechanism costs a rank does not grow with the job.
benchmarks/scale.py runs the simulation (threads as ranks over one counting store, the baked project's own
hang report); here at two small sizes, where an O(N) cost per rank already shows as a 4x difference."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import TEMPLATE_ROOT, run


@pytest.mark.slow
def test_side_group_hang_report_and_generator_states_cost_a_rank_the_same_at_any_size(tmp_path):
    figures = tmp_path / "scale.json"
    result = run([sys.executable, str(TEMPLATE_ROOT / "benchmarks" / "scale.py"), "--sizes", "8", "32",
                  "--rng-sizes", "8", "32", "--json", str(figures)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tables = json.loads(figures.read_text())

    def per_rank(title: str, cost: str) -> tuple[float, float]:
        return tables[title]["8"][cost], tables[title]["32"][cost]

    # The gloo side group, lazily connected: one address published, the ring's two neighbours connected.
    for cost in ("store requests", "store bytes", "sockets"):
        small, large = per_rank("Side group, lazy (ring): now", cost)
        assert small == large, (cost, small, large)
        eager_small, eager_large = per_rank("Side group, eager (full mesh): before", cost)
        assert eager_large > 2.5 * eager_small, (cost, eager_small, eager_large)  # the full mesh it replaced
    # The hang report: a constant number of store requests per rank (8: its report, its rank on two lists, the
    # count, the wait for the summary to be read, its machine's two lists; the first reporter reads the rest),
    # one summary; before, each rank read every rank's key.
    small, large = per_rank("Hang report: now", "store requests")
    assert small <= 9 and large <= 9, (small, large)
    assert per_rank("Hang report: before", "store requests")[1] > 60
    # The generator states: 5 KB a rank in the saved file, not lists of ints (twice the bytes, seconds to load).
    small, large = per_rank("Generator states as one uint8 tensor: now", "bytes")
    assert 5056 <= large < small < 5600, (small, large)
