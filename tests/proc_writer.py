"""A writer process driven line by line over stdin, for multi-process write tests.

Commands (one per line), each answered with one line on stdout once acknowledged
(``ok ...``) or failed (``err TypeName message``):

- ``write ID VALUE``: ``t.write`` of one full row (``id``, ``val``=VALUE, ``name``).
- ``writer``: claim the table's region with ``t.writer()`` (kept as ``w``).
- ``put ID VALUE``: ``w.put`` of one full row through that writer.
- ``loop START COUNT TAG``: ``t.write`` rows START..START+COUNT-1 one by one with
  ``val`` = TAG; answers ``ok`` and a JSON list of each write's ``[start, end]``
  (``time.monotonic()``, one clock for every process of the machine).
- ``stream START COUNT TAG``: ``t.write`` rows START..START+COUNT-1 one by one with
  ``val`` = TAG, answering ``ack K`` as soon as row K is acknowledged (the driving test
  kills the process mid-stream), then ``ok``.
- ``close``: close the table's writers (flushing) and exit.
- ``exit``: exit without closing anything (a script that ends without ``close``).
"""

from __future__ import annotations

import json
import sys
import time

import pyarrow as pa

import memwal_query as mq

PK = {"lance-schema:unenforced-primary-key": "true"}
DIM = 4
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("val", pa.float64()),
        pa.field("name", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)


def row(key: int, value: float) -> pa.Table:
    """Key ``key`` with value ``value``: text ``k{key} v{value}``, vector all ``value``."""
    vec = pa.FixedSizeListArray.from_arrays(pa.array([value] * DIM, pa.float32()), DIM)
    return pa.table(
        {"id": [key], "val": [value], "name": [f"k{key} v{int(value)}"], "vec": vec},
        schema=SCHEMA,
    )


def main(uri: str) -> None:
    t = mq.MemWalTable.open(uri)
    w = None
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "write":
                t.write(row(int(args[0]), float(args[1])))
                print("ok", flush=True)
            elif cmd == "writer":
                w = t.writer()
                print("ok", w.region_id, flush=True)
            elif cmd == "put":
                assert w is not None
                w.put(row(int(args[0]), float(args[1])))
                print("ok", flush=True)
            elif cmd == "loop":
                start, count, tag = int(args[0]), int(args[1]), float(args[2])
                times = []
                for k in range(start, start + count):
                    began = time.monotonic()
                    t.write(row(k, tag))
                    times.append([began, time.monotonic()])
                print("ok", json.dumps(times), flush=True)
            elif cmd == "stream":
                start, count, tag = int(args[0]), int(args[1]), float(args[2])
                for k in range(start, start + count):
                    t.write(row(k, tag))
                    print("ack", k, flush=True)
                print("ok", flush=True)
            elif cmd == "exit":
                print("ok", flush=True)
                return
            elif cmd == "close":
                t.close()
                if w is not None:
                    try:
                        w.close()
                    except mq.FencedError:
                        pass
                print("ok", flush=True)
                return
        except Exception as e:  # noqa: BLE001 - reported to the driving test
            print("err", type(e).__name__, str(e).replace("\n", " "), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
