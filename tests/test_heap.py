"""The heap setting every pipeline process takes (``pipeline.broker.stage.keep_heap_mapped``).

A stage reads a batch of up to 256 records off a ring; with 64 KiB bodies
inline that is many MiB, freed together when the batch is done. glibc's
default hands the freed top of the heap back to the OS each time (past twice
its largest mapping so far), and the next batch faults every page in again. Checked in fresh interpreters, by
the page faults the kernel counts.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

CHURN = """
import resource, sys
sys.path.insert(0, {root!r})
from pipeline.broker.stage import give_back_heap, keep_heap_mapped
if {keep}:
    assert keep_heap_mapped()
def churn():                                    # a batch of 64 KiB records read off a ring, then let go
    batch = [b"x" * 65536 for _ in range(160)]  # 10 MiB, every page written
    del batch
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    churn()
churned = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
held = [b"x" * 65536 for _ in range(64)]        # 4 MiB, then freed: an explicit trim still gives it back
del held
with open("/proc/self/statm") as f:
    rss_before = int(f.read().split()[1])
give_back_heap()
with open("/proc/self/statm") as f:
    rss_after = int(f.read().split()[1])
print(churned, rss_before - rss_after)
"""


def churn_faults(keep: bool) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHURN.format(root=str(ROOT), keep=keep)],
                         capture_output=True, text=True, timeout=60, check=True)
    faults, given_back = out.stdout.split()
    return int(faults), int(given_back)


def test_freeing_bodies_at_the_heap_top_costs_no_page_faults_once_the_heap_is_kept():
    default_faults, _ = churn_faults(keep=False)
    kept_faults, given_back_pages = churn_faults(keep=True)
    assert default_faults > 20 * 1000, default_faults       # glibc's default: most of the 2,560 pages each time
    assert kept_faults < 1000, kept_faults                   # kept: the same pages reused
    assert given_back_pages >= 1024, given_back_pages         # malloc_trim still returns what was kept (4 MiB or more)
