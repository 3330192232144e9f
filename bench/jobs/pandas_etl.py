"""pandas ETL: groupby/aggregate, merge with a dimension table, multi-key sort.

3M fact rows (int64 keys, float64 measures, a categorical), 200k dimension rows.
What a reporting job does: every step builds new columns and frames, so the
allocator sees many 8-32 MiB blocks with short lifetimes and hash tables.
"""
import numpy as np
import pandas as pd


def run(scale=1.0):
    rng = np.random.default_rng(11)
    n = int(3_000_000 * scale)
    nkeys = int(200_000 * scale)
    facts = pd.DataFrame({
        "key": rng.integers(0, nkeys, n),
        "store": rng.integers(0, 500, n).astype(np.int32),
        "qty": rng.integers(1, 20, n).astype(np.float64),
        "price": rng.random(n) * 100.0,
        "region": pd.Categorical.from_codes(rng.integers(0, 8, n), list("ABCDEFGH")),
    })
    dims = pd.DataFrame({"key": np.arange(nkeys), "weight": rng.random(nkeys),
                         "segment": rng.integers(0, 12, nkeys)})
    facts["revenue"] = facts["qty"] * facts["price"]
    by_key = facts.groupby("key").agg(rev=("revenue", "sum"), qty=("qty", "mean"),
                                      n=("price", "count"))
    by_region = facts.groupby(["region", "store"], observed=True)["revenue"].agg(["sum", "max"])
    joined = facts.merge(dims, on="key", how="left")
    joined["score"] = joined["revenue"] * joined["weight"]
    seg = joined.groupby("segment")["score"].sum()
    top = joined.sort_values(["segment", "score"], ascending=[True, False])
    head = top.groupby("segment").head(3)
    return float(by_key["rev"].sum() + by_region["max"].sum() + seg.sum() +
                 head["score"].sum())
