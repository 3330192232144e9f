"""pandas 3 ETL: groupby/aggregate on one and on two keys, a merge with the
aggregate, a two-key sort, a boolean filter and a rank.

3M order rows: an int64 customer key with about a million distinct values,
string columns (a 100k-value SKU, a 12-value region), int16 days, float64
amounts. Run as two jobs (bench/jobs/child.py): `pandas3_etl` with pyarrow
hidden, so pandas 3's default string dtype keeps its strings as Python objects
in NumPy object arrays, and `pandas3_arrow` with pyarrow, which moves the
string columns and their hashing into Arrow's own memory (not NumPy's).

What the allocator sees besides 24 MB columns: pandas' hash tables collect
their uniques in vectors that grow by ndarray.resize (realloc, x4 each step):
a million distinct customers realloc a block from 1 MiB through 4 MiB to
16 MiB and trim it to 8.4 MiB, and the two-key groupby's 2.7 million groups
one up to 64 MiB, trimmed to 20.7 MiB. That pattern made a one-arena policy peak
1.10x NumPy's default here (bench/results/jobs-size-class-trim.md).
"""
import numpy as np
import pandas as pd

STORAGE = {"pandas3_etl": "python", "pandas3_arrow": "pyarrow"}


def check(job):
    """The pandas version and string storage the job is meant to measure."""
    if int(pd.__version__.split(".")[0]) < 3:
        raise SystemExit("%s needs pandas >= 3, found %s (bench/setup.sh)" % (job, pd.__version__))
    got = pd.Series(["x"]).dtype.storage
    if got != STORAGE[job]:
        raise SystemExit("%s: pandas' default string storage is %r, expected %r%s" % (
            job, got, STORAGE[job], " (pip install pyarrow)" if STORAGE[job] == "pyarrow" else ""))


def run(scale=1.0):
    rng = np.random.default_rng(28)
    n = int(3_000_000 * scale)
    ncust = int(1_200_000 * scale)
    skus = np.array(["sku-%06d" % i for i in range(int(100_000 * scale))], dtype=object)
    regions = np.array(["region-%02d" % i for i in range(12)], dtype=object)
    orders = pd.DataFrame({
        "customer": rng.integers(0, ncust, n),
        "sku": skus[rng.integers(0, len(skus), n)],
        "region": regions[rng.integers(0, len(regions), n)],
        "day": rng.integers(0, 365, n).astype(np.int16),
        "qty": rng.integers(1, 10, n),
        "price": rng.gamma(2.0, 15.0, n),
    })
    orders["amount"] = orders["qty"] * orders["price"]
    per_customer = orders.groupby("customer").agg(spend=("amount", "sum"),
                                                  orders=("amount", "size"))
    per_cust_region = orders.groupby(["customer", "region"])["amount"].agg(["sum", "max"])
    joined = orders.merge(per_customer, left_on="customer", right_index=True, how="left")
    joined["share"] = joined["amount"] / joined["spend"]
    ranked = joined.sort_values(["region", "spend"], ascending=[True, False])
    big = ranked[ranked["share"] > 0.2]
    pos = big.groupby("sku")["amount"].rank(ascending=False)
    return float(per_cust_region["sum"].sum() + per_cust_region["max"].sum() +
                 pos.sum() + big["share"].sum() + ranked["spend"].iloc[:1000].sum())
