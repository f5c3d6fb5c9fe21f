"""TPC-H data, change rounds, the LSM tables, queries Q1-Q19 and answer comparison,
shared by ``benchmarks/tpch.py`` and ``tests/test_tpch.py``.

The generator is vectorised numpy with TPC-H's schema (prices and dates as float64 and
date32) and value distributions close to the specification's (dbgen's): the same key
spaces (orders use the first 8 of every 32 keys, customers whose key divides by 3 have
no orders, four suppliers per part by the specification's formula, lineitems' suppliers
among their part's), the same word lists for names, types, containers, segments,
priorities, ship modes and instructions, dates and the return flag / line status rules
around 1995-06-17. Comments are random words from a short list that holds the words the
queries look for (``special ... requests``, ``Customer ... Complaints``). It is not
dbgen's stream: figures are comparable between runs of this script, not with published
TPC-H results.

A change round (:func:`change_rounds`) is one of TPC-H's refresh functions widened:
orders replaced whole (new values, a new number of lines: lines beyond it are deleted),
orders deleted with their lines, new orders inserted in the key gaps dbgen leaves.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import memwal_query as mq

PK = {"lance-schema:unenforced-primary-key": "true"}
ORDERS_KEY = ["o_orderkey"]
LINEITEM_KEY = ["l_orderkey", "l_linenumber"]

NATIONS = [
    ("ALGERIA", 0),
    ("ARGENTINA", 1),
    ("BRAZIL", 1),
    ("CANADA", 1),
    ("EGYPT", 4),
    ("ETHIOPIA", 0),
    ("FRANCE", 3),
    ("GERMANY", 3),
    ("INDIA", 2),
    ("INDONESIA", 2),
    ("IRAN", 4),
    ("IRAQ", 4),
    ("JAPAN", 2),
    ("JORDAN", 4),
    ("KENYA", 0),
    ("MOROCCO", 0),
    ("MOZAMBIQUE", 0),
    ("PERU", 1),
    ("CHINA", 2),
    ("ROMANIA", 3),
    ("SAUDI ARABIA", 4),
    ("VIETNAM", 2),
    ("RUSSIA", 3),
    ("UNITED KINGDOM", 3),
    ("UNITED STATES", 1),
]
REGION_NAMES = ["AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST"]
COLORS = (
    "almond antique aquamarine azure beige bisque black blanched blue blush brown "
    "burlywood burnished chartreuse chiffon chocolate coral cornflower cornsilk cream "
    "cyan dark deep dim dodger drab firebrick floral forest frosted gainsboro ghost "
    "goldenrod green grey honeydew hot indian ivory khaki lace lavender lawn lemon "
    "light lime linen magenta maroon medium metallic midnight mint misty moccasin "
    "navajo navy olive orange orchid pale papaya peach peru pink plum powder puff "
    "purple red rose rosy royal saddle salmon sandy seashell sienna sky slate smoke "
    "snow spring steel tan thistle tomato turquoise violet wheat white yellow"
).split()
TYPE_1 = ["STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO"]
TYPE_2 = ["ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED"]
TYPE_3 = ["TIN", "NICKEL", "BRASS", "STEEL", "COPPER"]
CONTAINER_1 = ["SM", "LG", "MED", "JUMBO", "WRAP"]
CONTAINER_2 = ["CASE", "BOX", "BAG", "JAR", "PKG", "PACK", "CAN", "DRUM"]
SEGMENTS = ["AUTOMOBILE", "BUILDING", "FURNITURE", "MACHINERY", "HOUSEHOLD"]
PRIORITIES = ["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW"]
INSTRUCTIONS = ["DELIVER IN PERSON", "COLLECT COD", "NONE", "TAKE BACK RETURN"]
MODES = ["REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB"]
WORDS = (
    "furiously quickly carefully blithely slyly ironic final regular express bold even "
    "silent unusual pending special requests deposits accounts packages theodolites "
    "instructions foxes dependencies excuses platelets asymptotes courts dolphins "
    "multipliers sauternes warthogs frets dinos attainments somas patterns forges "
    "braids ideas pinto beans sleep wake haggle nag cajole detect integrate about "
    "above across after against along among around"
).split()

DAY = np.datetime64("1970-01-01", "D")
START = int((np.datetime64("1992-01-01", "D") - DAY).astype(int))
END = int((np.datetime64("1998-12-31", "D") - DAY).astype(int))
CURRENT = int((np.datetime64("1995-06-17", "D") - DAY).astype(int))


def _pick(words: list[str], idx: np.ndarray) -> pa.Array:
    return pa.array(words, pa.string()).take(pa.array(idx))


def _text(rng: np.random.Generator, n: int, words: int) -> pa.Array:
    """``n`` strings of ``words`` random words (vectorised)."""
    parts = [_pick(WORDS, rng.integers(0, len(WORDS), n)) for _ in range(words)]
    return pc.binary_join_element_wise(*parts, " ")


def _numbered(prefix: str, keys: np.ndarray, width: int) -> pa.Array:
    digits = pc.utf8_lpad(pc.cast(pa.array(keys), pa.string()), width, "0")
    return pc.binary_join_element_wise(pa.scalar(prefix), digits, "")


def _phone(rng: np.random.Generator, nation: np.ndarray) -> pa.Array:
    n = len(nation)
    parts = [pc.cast(pa.array(nation + 10), pa.string())]
    for lo, hi in ((100, 1000), (100, 1000), (1000, 10000)):
        parts.append(pc.cast(pa.array(rng.integers(lo, hi, n)), pa.string()))
    return pc.binary_join_element_wise(*parts, "-")


def _money(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    return rng.integers(round(lo * 100), round(hi * 100) + 1, n) / 100.0


def _field(name: str, type_: pa.DataType, key: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=not key, metadata=PK if key else None)


ORDERS_SCHEMA = pa.schema(
    [
        _field("o_orderkey", pa.int64(), True),
        _field("o_custkey", pa.int64()),
        _field("o_orderstatus", pa.string()),
        _field("o_totalprice", pa.float64()),
        _field("o_orderdate", pa.date32()),
        _field("o_orderpriority", pa.string()),
        _field("o_clerk", pa.string()),
        _field("o_shippriority", pa.int32()),
        _field("o_comment", pa.string()),
    ]
)
LINEITEM_SCHEMA = pa.schema(
    [
        _field("l_orderkey", pa.int64(), True),
        _field("l_partkey", pa.int64()),
        _field("l_suppkey", pa.int64()),
        _field("l_linenumber", pa.int32(), True),
        _field("l_quantity", pa.float64()),
        _field("l_extendedprice", pa.float64()),
        _field("l_discount", pa.float64()),
        _field("l_tax", pa.float64()),
        _field("l_returnflag", pa.string()),
        _field("l_linestatus", pa.string()),
        _field("l_shipdate", pa.date32()),
        _field("l_commitdate", pa.date32()),
        _field("l_receiptdate", pa.date32()),
        _field("l_shipinstruct", pa.string()),
        _field("l_shipmode", pa.string()),
        _field("l_comment", pa.string()),
    ]
)


@dataclass(frozen=True)
class Scale:
    """Row counts of a scale factor (TPC-H's, at least a few rows each)."""

    sf: float

    @property
    def suppliers(self) -> int:
        return max(100, round(10_000 * self.sf))

    @property
    def parts(self) -> int:
        return max(2_000, round(200_000 * self.sf))

    @property
    def customers(self) -> int:
        return max(150, round(150_000 * self.sf))

    @property
    def orders(self) -> int:
        return max(100, round(1_500_000 * self.sf))


def retail_price(partkey: np.ndarray) -> np.ndarray:
    """``p_retailprice`` of the specification (a function of the key)."""
    return (90_000 + (partkey // 10) % 20_001 + 100 * (partkey % 1000)) / 100.0


def part_supplier(partkey: np.ndarray, i: np.ndarray, suppliers: int) -> np.ndarray:
    """The ``i``-th (0..3) supplier of each part (the specification's formula)."""
    return (partkey + i * (suppliers // 4 + (partkey - 1) // suppliers)) % suppliers + 1


def order_key(i: np.ndarray) -> np.ndarray:
    """The ``i``-th order key dbgen uses: the first 8 of every 32."""
    return (i // 8) * 32 + i % 8 + 1


def gap_key(i: np.ndarray) -> np.ndarray:
    """The ``i``-th key dbgen leaves free (the other 24 of every 32): new orders."""
    return (i // 24) * 32 + 8 + i % 24 + 1


def _party(rng: np.random.Generator, p: str, prefix: str, n: int) -> pa.Table:
    """The columns suppliers and customers share: key, name, address, nation, phone,
    account balance (``p``: the column prefix)."""
    keys = np.arange(1, n + 1)
    nation = rng.integers(0, 25, n)
    return pa.table(
        {
            f"{p}_{'suppkey' if p == 's' else 'custkey'}": pa.array(keys, pa.int64()),
            f"{p}_name": _numbered(prefix, keys, 9),
            f"{p}_address": _text(rng, n, 2),
            f"{p}_nationkey": pa.array(nation, pa.int64()),
            f"{p}_phone": _phone(rng, nation),
            f"{p}_acctbal": pa.array(_money(rng, n, -999.99, 9999.99)),
        }
    )


def generate(sf: float, seed: int = 0) -> dict[str, pa.Table]:
    """The eight TPC-H tables at scale factor ``sf``."""
    rng = np.random.default_rng(seed)
    s = Scale(sf)
    region = pa.table(
        {
            "r_regionkey": pa.array(np.arange(5), pa.int64()),
            "r_name": pa.array(REGION_NAMES),
            "r_comment": _text(rng, 5, 6),
        }
    )
    nation = pa.table(
        {
            "n_nationkey": pa.array(np.arange(25), pa.int64()),
            "n_name": pa.array([n for n, _ in NATIONS]),
            "n_regionkey": pa.array([r for _, r in NATIONS], pa.int64()),
            "n_comment": _text(rng, 25, 6),
        }
    )
    s_comment = _text(rng, s.suppliers, 6).to_pylist()
    for j in rng.choice(s.suppliers, max(1, s.suppliers // 100), replace=False):
        s_comment[j] = f"carefully Customer final {WORDS[j % len(WORDS)]} Complaints"
    supplier = _party(rng, "s", "Supplier#", s.suppliers)
    supplier = supplier.append_column("s_comment", pa.array(s_comment, pa.string()))
    pk = np.arange(1, s.parts + 1)
    n = len(pk)
    mfgr = rng.integers(1, 6, n)
    brand = mfgr * 10 + rng.integers(1, 6, n)
    colors = [_pick(COLORS, rng.integers(0, len(COLORS), n)) for _ in range(5)]
    part = pa.table(
        {
            "p_partkey": pa.array(pk, pa.int64()),
            "p_name": pc.binary_join_element_wise(*colors, " "),
            "p_mfgr": _numbered("Manufacturer#", mfgr, 1),
            "p_brand": _numbered("Brand#", brand, 2),
            "p_type": pc.binary_join_element_wise(
                _pick(TYPE_1, rng.integers(0, 6, n)),
                _pick(TYPE_2, rng.integers(0, 5, n)),
                _pick(TYPE_3, rng.integers(0, 5, n)),
                " ",
            ),
            "p_size": pa.array(rng.integers(1, 51, n), pa.int32()),
            "p_container": pc.binary_join_element_wise(
                _pick(CONTAINER_1, rng.integers(0, 5, n)),
                _pick(CONTAINER_2, rng.integers(0, 8, n)),
                " ",
            ),
            "p_retailprice": pa.array(retail_price(pk)),
            "p_comment": _text(rng, n, 3),
        }
    )
    ps_part = np.repeat(pk, 4)
    ps_supp = part_supplier(ps_part, np.tile(np.arange(4), n), s.suppliers)
    partsupp = pa.table(
        {
            "ps_partkey": pa.array(ps_part, pa.int64()),
            "ps_suppkey": pa.array(ps_supp, pa.int64()),
            "ps_availqty": pa.array(rng.integers(1, 10_000, len(ps_part)), pa.int32()),
            "ps_supplycost": pa.array(_money(rng, len(ps_part), 1.0, 1000.0)),
            "ps_comment": _text(rng, len(ps_part), 8),
        }
    )
    customer = _party(rng, "c", "Customer#", s.customers)
    customer = customer.append_column(
        "c_mktsegment", _pick(SEGMENTS, rng.integers(0, 5, s.customers))
    )
    customer = customer.append_column("c_comment", _text(rng, s.customers, 6))
    orders, lineitem = order_rows(order_key(np.arange(s.orders)), s, rng)
    return {
        "region": region,
        "nation": nation,
        "supplier": supplier,
        "part": part,
        "partsupp": partsupp,
        "customer": customer,
        "orders": orders,
        "lineitem": lineitem,
    }


def order_rows(keys: np.ndarray, s: Scale, rng: np.random.Generator) -> tuple[pa.Table, pa.Table]:
    """Orders with keys ``keys`` and their 1-7 lineitems each (new random values)."""
    n = len(keys)
    k = rng.integers(0, s.customers * 2 // 3, n)
    custkey = np.minimum(3 * (k // 2) + k % 2 + 1, s.customers)  # never a multiple of 3
    orderdate = rng.integers(START, END - 151 + 1, n)
    lines = rng.integers(1, 8, n)
    owner = np.repeat(np.arange(n), lines)
    m = len(owner)
    starts = np.cumsum(lines) - lines
    linenumber = np.arange(m) - np.repeat(starts, lines) + 1
    partkey = rng.integers(1, s.parts + 1, m)
    suppkey = part_supplier(partkey, rng.integers(0, 4, m), s.suppliers)
    quantity = rng.integers(1, 51, m).astype(np.float64)
    price = quantity * retail_price(partkey)
    discount = rng.integers(0, 11, m) / 100.0
    tax = rng.integers(0, 9, m) / 100.0
    odate = orderdate[owner]
    shipdate = odate + rng.integers(1, 122, m)
    commitdate = odate + rng.integers(30, 91, m)
    receiptdate = shipdate + rng.integers(1, 31, m)
    returned = np.where(rng.integers(0, 2, m) == 0, "R", "A")
    flag = np.where(receiptdate <= CURRENT, returned, "N")
    status = np.where(shipdate > CURRENT, "O", "F")
    is_f = np.bincount(owner, weights=status == "F", minlength=n)
    o_status = np.where(is_f == lines, "F", np.where(is_f == 0, "O", "P"))
    total = np.bincount(owner, weights=price * (1 + tax) * (1 - discount), minlength=n)
    clerks = max(1, round(s.sf * 1000))
    orders = pa.table(
        {
            "o_orderkey": pa.array(keys, pa.int64()),
            "o_custkey": pa.array(custkey, pa.int64()),
            "o_orderstatus": pa.array(o_status),
            "o_totalprice": pa.array(np.round(total, 2)),
            "o_orderdate": pa.array(orderdate.astype(np.int32), pa.date32()),
            "o_orderpriority": _pick(PRIORITIES, rng.integers(0, 5, n)),
            "o_clerk": _numbered("Clerk#", rng.integers(1, clerks + 1, n), 9),
            "o_shippriority": pa.array(np.zeros(n, np.int32)),
            "o_comment": _text(rng, n, 6),
        },
        schema=ORDERS_SCHEMA,
    )
    lineitem = pa.table(
        {
            "l_orderkey": pa.array(keys[owner], pa.int64()),
            "l_partkey": pa.array(partkey, pa.int64()),
            "l_suppkey": pa.array(suppkey, pa.int64()),
            "l_linenumber": pa.array(linenumber.astype(np.int32)),
            "l_quantity": pa.array(quantity),
            "l_extendedprice": pa.array(price),
            "l_discount": pa.array(discount),
            "l_tax": pa.array(tax),
            "l_returnflag": pa.array(flag),
            "l_linestatus": pa.array(status),
            "l_shipdate": pa.array(shipdate.astype(np.int32), pa.date32()),
            "l_commitdate": pa.array(commitdate.astype(np.int32), pa.date32()),
            "l_receiptdate": pa.array(receiptdate.astype(np.int32), pa.date32()),
            "l_shipinstruct": _pick(INSTRUCTIONS, rng.integers(0, 4, m)),
            "l_shipmode": _pick(MODES, rng.integers(0, 7, m)),
            "l_comment": _text(rng, m, 4),
        },
        schema=LINEITEM_SCHEMA,
    )
    return orders, lineitem


@dataclass
class Round:
    """One round of changes: rows to write and keys to delete, per table."""

    orders: pa.Table
    lineitem: pa.Table
    orders_deleted: pa.Table
    lineitem_deleted: pa.Table


def _without(table: pa.Table, column: str, keys: np.ndarray) -> pa.Table:
    return table.filter(pc.invert(pc.is_in(table.column(column), pa.array(keys))))


def change_rounds(
    tables: dict[str, pa.Table], sf: float, rounds: int = 3, share: float = 0.02, seed: int = 1
) -> tuple[list[Round], dict[str, pa.Table]]:
    """``rounds`` rounds of changes to ``orders`` and ``lineitem``, and both tables as
    they are after them (the model).

    Each round replaces ``share`` of the live orders whole (their lines too: an order
    that gets fewer lines has the others deleted), deletes a quarter as many orders with
    their lines, and inserts a quarter as many new orders in dbgen's key gaps.
    """
    rng = np.random.default_rng(seed)
    s = Scale(sf)
    orders, lineitem = tables["orders"], tables["lineitem"]
    out = []
    next_gap = 0
    for _ in range(rounds):
        live = orders.column("o_orderkey").to_numpy()
        n_upd = max(1, round(len(live) * share))
        n_del = max(1, n_upd // 4)
        picked = rng.choice(live, n_upd + n_del, replace=False)
        upd, dele = picked[:n_upd], picked[n_upd:]
        new = gap_key(np.arange(next_gap, next_gap + n_del))
        next_gap += n_del
        o_rows, l_rows = order_rows(np.concatenate([upd, new]), s, rng)
        touched = np.concatenate([upd, dele])
        old = lineitem.filter(pc.is_in(lineitem.column("l_orderkey"), pa.array(touched)))
        old = old.select(LINEITEM_KEY)
        kept = l_rows.select(LINEITEM_KEY)
        gone = old.join(kept, LINEITEM_KEY, join_type="left anti")
        out.append(
            Round(
                orders=o_rows,
                lineitem=l_rows,
                orders_deleted=pa.table({"o_orderkey": pa.array(dele, pa.int64())}),
                lineitem_deleted=gone.combine_chunks(),
            )
        )
        orders = pa.concat_tables([_without(orders, "o_orderkey", touched), o_rows])
        lineitem = pa.concat_tables([_without(lineitem, "l_orderkey", touched), l_rows])
    final = dict(tables, orders=orders.combine_chunks(), lineitem=lineitem.combine_chunks())
    return out, final


LSM_TABLES = {"orders": "o_orderkey", "lineitem": "l_orderkey"}
"""The tables stored as LSM tables, and the column of their bucket regions (an order
and its lines share a region number)."""
LSM_REGIONS = 4


def build(
    root: str, tables: dict[str, pa.Table], rounds: list[Round], unflushed: int = 0
) -> dict[str, str]:
    """``orders`` and ``lineitem`` as LSM tables under ``root`` (:data:`LSM_REGIONS` bucket
    regions each) with every round written through ``t.write`` and ``t.delete`` and
    flushed, except the last ``unflushed`` rounds (left in the WAL, which readers
    see). Returns ``{name: uri}``."""
    uris = {}
    for name, bucket_col in LSM_TABLES.items():
        uri = f"{root}/{name}"
        lance.write_dataset(tables[name], uri)
        spec = mq.bucket_spec(lance.dataset(uri).lance_schema, bucket_col, LSM_REGIONS)
        t = mq.MemWalTable.initialize(uri, region_spec=spec)
        for i, r in enumerate(rounds):
            t.write(getattr(r, name))
            t.delete(getattr(r, f"{name}_deleted"))
            if i < len(rounds) - unflushed:
                t.flush()
        t.close(flush=unflushed == 0)
        uris[name] = uri
    return uris


def partitions(table: pa.Table, n: int) -> list[list[pa.RecordBatch]]:
    """``table`` in ``n`` partitions of about equal rows (DataFusion scans each on its
    own thread)."""
    step = max(1, -(-table.num_rows // n))
    return [table.slice(i * step, step).to_batches() for i in range(n)]


def context(
    arrow: dict[str, pa.Table], uris: dict[str, str] | None = None
) -> datafusion.SessionContext:
    """A DataFusion session with the Arrow tables ``arrow`` (partitioned by the cores),
    the ones named in ``uris`` registered from those LSM tables instead."""
    ctx = datafusion.SessionContext()
    for name, table in arrow.items():
        if uris is None or name not in uris:
            ctx.register_record_batches(name, partitions(table, os.cpu_count() or 1))
    for name, uri in (uris or {}).items():
        mq.register(ctx, name, uri)
    return ctx


def queries(sf: float) -> dict[int, str]:
    """TPC-H Q1-Q19 with the specification's validation parameters (Q11's fraction
    scaled by ``sf``), in DataFusion's SQL; Q15's view is a common table expression."""
    return {
        1: """
select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty,
  sum(l_extendedprice) as sum_base_price,
  sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
  sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
  avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price,
  avg(l_discount) as avg_disc, count(*) as count_order
from lineitem
where l_shipdate <= date '1998-12-01' - interval '90' day
group by l_returnflag, l_linestatus
order by l_returnflag, l_linestatus""",
        2: """
select s_acctbal, s_name, n_name, p_partkey, p_mfgr, s_address, s_phone, s_comment
from part, supplier, partsupp, nation, region
where p_partkey = ps_partkey and s_suppkey = ps_suppkey and p_size = 15
  and p_type like '%BRASS' and s_nationkey = n_nationkey
  and n_regionkey = r_regionkey and r_name = 'EUROPE'
  and ps_supplycost = (
    select min(ps_supplycost) from partsupp, supplier, nation, region
    where p_partkey = ps_partkey and s_suppkey = ps_suppkey
      and s_nationkey = n_nationkey and n_regionkey = r_regionkey
      and r_name = 'EUROPE')
order by s_acctbal desc, n_name, s_name, p_partkey
limit 100""",
        3: """
select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue,
  o_orderdate, o_shippriority
from customer, orders, lineitem
where c_mktsegment = 'BUILDING' and c_custkey = o_custkey and l_orderkey = o_orderkey
  and o_orderdate < date '1995-03-15' and l_shipdate > date '1995-03-15'
group by l_orderkey, o_orderdate, o_shippriority
order by revenue desc, o_orderdate
limit 10""",
        4: """
select o_orderpriority, count(*) as order_count
from orders
where o_orderdate >= date '1993-07-01'
  and o_orderdate < date '1993-07-01' + interval '3' month
  and exists (
    select * from lineitem
    where l_orderkey = o_orderkey and l_commitdate < l_receiptdate)
group by o_orderpriority
order by o_orderpriority""",
        5: """
select n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
from customer, orders, lineitem, supplier, nation, region
where c_custkey = o_custkey and l_orderkey = o_orderkey and l_suppkey = s_suppkey
  and c_nationkey = s_nationkey and s_nationkey = n_nationkey
  and n_regionkey = r_regionkey and r_name = 'ASIA'
  and o_orderdate >= date '1994-01-01'
  and o_orderdate < date '1994-01-01' + interval '1' year
group by n_name
order by revenue desc""",
        6: """
select sum(l_extendedprice * l_discount) as revenue
from lineitem
where l_shipdate >= date '1994-01-01'
  and l_shipdate < date '1994-01-01' + interval '1' year
  and l_discount between 0.06 - 0.01 and 0.06 + 0.01 and l_quantity < 24""",
        7: """
select supp_nation, cust_nation, l_year, sum(volume) as revenue
from (
  select n1.n_name as supp_nation, n2.n_name as cust_nation,
    extract(year from l_shipdate) as l_year,
    l_extendedprice * (1 - l_discount) as volume
  from supplier, lineitem, orders, customer, nation n1, nation n2
  where s_suppkey = l_suppkey and o_orderkey = l_orderkey and c_custkey = o_custkey
    and s_nationkey = n1.n_nationkey and c_nationkey = n2.n_nationkey
    and ((n1.n_name = 'FRANCE' and n2.n_name = 'GERMANY')
      or (n1.n_name = 'GERMANY' and n2.n_name = 'FRANCE'))
    and l_shipdate between date '1995-01-01' and date '1996-12-31'
) as shipping
group by supp_nation, cust_nation, l_year
order by supp_nation, cust_nation, l_year""",
        8: """
select o_year,
  sum(case when nation = 'BRAZIL' then volume else 0 end) / sum(volume) as mkt_share
from (
  select extract(year from o_orderdate) as o_year,
    l_extendedprice * (1 - l_discount) as volume, n2.n_name as nation
  from part, supplier, lineitem, orders, customer, nation n1, nation n2, region
  where p_partkey = l_partkey and s_suppkey = l_suppkey and l_orderkey = o_orderkey
    and o_custkey = c_custkey and c_nationkey = n1.n_nationkey
    and n1.n_regionkey = r_regionkey and r_name = 'AMERICA'
    and s_nationkey = n2.n_nationkey
    and o_orderdate between date '1995-01-01' and date '1996-12-31'
    and p_type = 'ECONOMY ANODIZED STEEL'
) as all_nations
group by o_year
order by o_year""",
        9: """
select nation, o_year, sum(amount) as sum_profit
from (
  select n_name as nation, extract(year from o_orderdate) as o_year,
    l_extendedprice * (1 - l_discount) - ps_supplycost * l_quantity as amount
  from part, supplier, lineitem, partsupp, orders, nation
  where s_suppkey = l_suppkey and ps_suppkey = l_suppkey and ps_partkey = l_partkey
    and p_partkey = l_partkey and o_orderkey = l_orderkey
    and s_nationkey = n_nationkey and p_name like '%green%'
) as profit
group by nation, o_year
order by nation, o_year desc""",
        10: """
select c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) as revenue,
  c_acctbal, n_name, c_address, c_phone, c_comment
from customer, orders, lineitem, nation
where c_custkey = o_custkey and l_orderkey = o_orderkey
  and o_orderdate >= date '1993-10-01'
  and o_orderdate < date '1993-10-01' + interval '3' month
  and l_returnflag = 'R' and c_nationkey = n_nationkey
group by c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
order by revenue desc
limit 20""",
        11: f"""
select ps_partkey, sum(ps_supplycost * ps_availqty) as value
from partsupp, supplier, nation
where ps_suppkey = s_suppkey and s_nationkey = n_nationkey and n_name = 'GERMANY'
group by ps_partkey
having sum(ps_supplycost * ps_availqty) > (
  select sum(ps_supplycost * ps_availqty) * {0.0001 / sf!r}
  from partsupp, supplier, nation
  where ps_suppkey = s_suppkey and s_nationkey = n_nationkey and n_name = 'GERMANY')
order by value desc""",
        12: """
select l_shipmode,
  sum(case when o_orderpriority = '1-URGENT' or o_orderpriority = '2-HIGH'
      then 1 else 0 end) as high_line_count,
  sum(case when o_orderpriority <> '1-URGENT' and o_orderpriority <> '2-HIGH'
      then 1 else 0 end) as low_line_count
from orders, lineitem
where o_orderkey = l_orderkey and l_shipmode in ('MAIL', 'SHIP')
  and l_commitdate < l_receiptdate and l_shipdate < l_commitdate
  and l_receiptdate >= date '1994-01-01'
  and l_receiptdate < date '1994-01-01' + interval '1' year
group by l_shipmode
order by l_shipmode""",
        13: """
select c_count, count(*) as custdist
from (
  select c_custkey, count(o_orderkey) as c_count
  from customer left outer join orders
    on c_custkey = o_custkey and o_comment not like '%special%requests%'
  group by c_custkey
) as c_orders
group by c_count
order by custdist desc, c_count desc""",
        14: """
select 100.00 * sum(case when p_type like 'PROMO%'
    then l_extendedprice * (1 - l_discount) else 0 end)
  / sum(l_extendedprice * (1 - l_discount)) as promo_revenue
from lineitem, part
where l_partkey = p_partkey and l_shipdate >= date '1995-09-01'
  and l_shipdate < date '1995-09-01' + interval '1' month""",
        # the revenue is rounded to cents: DataFusion may add a float sum in another
        # order in the two uses of the expression, and the maximum must match itself
        15: """
with revenue0 as (
  select l_suppkey as supplier_no,
    round(sum(l_extendedprice * (1 - l_discount)), 2) as total_revenue
  from lineitem
  where l_shipdate >= date '1996-01-01'
    and l_shipdate < date '1996-01-01' + interval '3' month
  group by l_suppkey)
select s_suppkey, s_name, s_address, s_phone, total_revenue
from supplier, revenue0
where s_suppkey = supplier_no
  and total_revenue = (select max(total_revenue) from revenue0)
order by s_suppkey""",
        16: """
select p_brand, p_type, p_size, count(distinct ps_suppkey) as supplier_cnt
from partsupp, part
where p_partkey = ps_partkey and p_brand <> 'Brand#45'
  and p_type not like 'MEDIUM POLISHED%'
  and p_size in (49, 14, 23, 45, 19, 3, 36, 9)
  and ps_suppkey not in (
    select s_suppkey from supplier where s_comment like '%Customer%Complaints%')
group by p_brand, p_type, p_size
order by supplier_cnt desc, p_brand, p_type, p_size""",
        17: """
select sum(l_extendedprice) / 7.0 as avg_yearly
from lineitem, part
where p_partkey = l_partkey and p_brand = 'Brand#23' and p_container = 'MED BOX'
  and l_quantity < (
    select 0.2 * avg(l_quantity) from lineitem where l_partkey = p_partkey)""",
        18: """
select c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice, sum(l_quantity)
from customer, orders, lineitem
where o_orderkey in (
    select l_orderkey from lineitem group by l_orderkey having sum(l_quantity) > 300)
  and c_custkey = o_custkey and o_orderkey = l_orderkey
group by c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice
order by o_totalprice desc, o_orderdate
limit 100""",
        19: """
select sum(l_extendedprice * (1 - l_discount)) as revenue
from lineitem, part
where (p_partkey = l_partkey and p_brand = 'Brand#12'
    and p_container in ('SM CASE', 'SM BOX', 'SM PACK', 'SM PKG')
    and l_quantity >= 1 and l_quantity <= 1 + 10 and p_size between 1 and 5
    and l_shipmode in ('AIR', 'AIR REG') and l_shipinstruct = 'DELIVER IN PERSON')
  or (p_partkey = l_partkey and p_brand = 'Brand#23'
    and p_container in ('MED BAG', 'MED BOX', 'MED PKG', 'MED PACK')
    and l_quantity >= 10 and l_quantity <= 10 + 10 and p_size between 1 and 10
    and l_shipmode in ('AIR', 'AIR REG') and l_shipinstruct = 'DELIVER IN PERSON')
  or (p_partkey = l_partkey and p_brand = 'Brand#34'
    and p_container in ('LG CASE', 'LG BOX', 'LG PACK', 'LG PKG')
    and l_quantity >= 20 and l_quantity <= 20 + 10 and p_size between 1 and 15
    and l_shipmode in ('AIR', 'AIR REG') and l_shipinstruct = 'DELIVER IN PERSON')""",
    }


def _floats(t: pa.Table) -> list[str]:
    return [f.name for f in t.schema if pa.types.is_floating(f.type)]


def differ(got: pa.Table, want: pa.Table, rel: float = 1e-9) -> str | None:
    """Why ``got`` is not the same rows as ``want`` (None: it is): sorted by the
    columns that are not floats (then the floats), equal exactly except floats, which
    are equal to ``rel`` relative (or 1e-6 absolute) tolerance."""
    if got.column_names != want.column_names:
        return f"columns {got.column_names} != {want.column_names}"
    if got.num_rows != want.num_rows:
        return f"{got.num_rows} rows != {want.num_rows}"
    floats = _floats(want)
    order = [(c, "ascending") for c in want.column_names if c not in floats]
    order += [(c, "ascending") for c in floats]
    got, want = got.sort_by(order), want.sort_by(order)
    for name in want.column_names:
        a, b = got.column(name), want.column(name)
        if name in floats:
            x = a.to_numpy(zero_copy_only=False).astype(np.float64)
            y = b.to_numpy(zero_copy_only=False).astype(np.float64)
            close = np.isclose(x, y, rtol=rel, atol=1e-6) | (np.isnan(x) & np.isnan(y))
            if not close.all():
                i = int(np.argmin(close))
                return f"{name} row {i}: {x[i]!r} != {y[i]!r}"
        elif not a.cast(b.type).equals(b):
            bad = pc.invert(pc.equal(a.cast(b.type), b)).to_numpy(zero_copy_only=False)
            i = int(np.argmax(bad)) if bad.any() else 0
            return f"{name} row {i}: {a[i]!r} != {b[i]!r}"
    return None


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))
