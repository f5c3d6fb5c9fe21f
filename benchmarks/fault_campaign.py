"""The full fault campaign on every object store (see ``tests/store_faults.py``).

``python benchmarks/fault_campaign.py [--faults N] [--seed S] [--stores s3,azure,gcs]``:
N injected faults per store (default 350, so >= 1,000 over the three stores) during
durable puts, flushes, merges, GC and reads, each checked against the model of
acknowledged rows, then recovery and fsck; prints the counts (faults by kind and
operation, retries, typed errors, rows checked). Exits non-zero on any disagreement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import store_faults  # noqa: E402
from _common import machine  # noqa: E402
from stores import STORES, start_store  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=350, help="faults per store")
    parser.add_argument("--seed", type=int, default=20261127)
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args()
    figures = []
    for kind in args.stores.split(","):
        server = start_store(kind)
        try:
            server.create_bucket("memwal-test")
            figures.append(store_faults.run(kind, server, seed=args.seed, faults=args.faults))
            print(store_faults.summary(figures[-1:]), flush=True)
        finally:
            server.stop()
    print(f"\nmachine: {machine()}")
    print(store_faults.summary(figures))


if __name__ == "__main__":
    main()
