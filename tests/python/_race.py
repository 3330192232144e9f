"""Threads racing datamem's shared state (run by test_free_threading.py in its
own interpreter: it installs policies and starts profiles).

    python _race.py DIR MUTATORS ALLOCATORS ITERATIONS

MUTATORS threads at once install, reload, tag, explain, read stats, start and
stop profiles, make call-site rules meet new code objects and install policies
with dtype rules, while ALLOCATORS threads make arrays, check them and hand them
to each other (and the mutators hand theirs over too); a fifth of the arrays,
tagged or not, are made by a shared ThreadPoolExecutor (the first tags race
to wrap its submit; the tag must reach the pool thread for that array only).
Every array's arena and
contents are checked by whoever frees it; at the end every arena's live count
(allocations - frees) is compared, exactly, with the arrays still held, and
again after they are all freed. Prints one JSON object; exits 1 on any failure.

On a free-threaded CPython these threads run at once; on a GIL build the same
code runs and only races less. All policies route the checked arrays alike, so
an install racing an allocation never changes where it belongs (only the start
policy, before the first install of A has returned, differs: then either
arena is right).
"""
import json
import os
import queue
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import datamem
from datamem import _ext

KIB, MIB = 1024, 1024 * 1024
STORM = 64  # rounds in which every mutator asks for one new tag set at once
# Arenas only the checked arrays use: their live counts must be exact.
OURS = ("workers", "f32", "tagged", "site", "big")

ARENAS = """\
arenas:
  general: {}
  workers: {}
  tagged: {}
"""
START = "version: 1\ndefault: general\n" + ARENAS + """\
rules:
  - name: hot
    match: {tag: hot}
    arena: tagged
  - name: workers
    match: {thread: "alloc-*", size: {min: 1KiB}}
    arena: workers
"""
RULES = """\
rules:
  - name: site
    match: {function: "sitemod.site_fn_*", size: {min: 1KiB}}
    arena: site
  - name: big
    match: {size: {min: 4MiB}}
    arena: big
  - name: hot
    match: {tag: hot}
    arena: tagged
  - name: f32
    match: {dtype: float32, size: {min: 1KiB}}
    arena: f32
  - name: workers
    match: {thread: "alloc-*", size: {min: 1KiB}}
    arena: workers
"""
ARENAS += "  f32: {}\n  site: {}\n  big: {}\n"
A = "version: 1\ndefault: general\n" + ARENAS + RULES
# B routes the checked arrays as A does; it differs elsewhere (another arena,
# a rule for a tag no checked array carries, another decay).
B = ("version: 1\ndefault: general\n" + ARENAS + "  spare: {decay: {dirty: 1s}}\n"
     + RULES + "  - name: cold\n    match: {tag: cold}\n    arena: spare\n")


def expected(nbytes, dtype, tagged, site, alloc_thread, policy_a):
    """The arena an array belongs to under A (and B), or under START."""
    if policy_a and site and nbytes >= KIB:
        return "site"
    if policy_a and nbytes >= 4 * MIB:
        return "big"
    if tagged:
        return "tagged"
    if policy_a and dtype == np.float32 and nbytes >= KIB:
        return "f32"
    if alloc_thread and nbytes >= KIB:
        return "workers"
    return "general"


class Race:
    def __init__(self, d, nmut, nalloc, iters):
        self.dir, self.iters = d, iters
        self.paths = {}
        for name, text in (("start", START), ("A", A), ("B", B)):
            self.paths[name] = os.path.join(d, name + ".yaml")
            with open(self.paths[name], "w") as f:
                f.write(text)
        self.nmut, self.nalloc = nmut, nalloc
        self.queues = [queue.Queue(maxsize=8) for _ in range(nalloc)]
        self.a_in_force = threading.Event()  # the first install of A has returned
        self.go = threading.Barrier(nmut + nalloc + 1)
        self.round = threading.Barrier(nmut)  # the mutators' storm of new tag sets
        self.done = threading.Barrier(nmut + nalloc + 1)
        self.errors = []
        self.held = {}  # thread name -> arrays it still holds at the end
        self.counts = {"arrays": 0, "checked": 0, "installs": 0, "reloads": 0,
                       "profiles": 0, "profile_refusals": 0, "sites": 0, "explains": 0,
                       "stats": 0, "tags": 0, "handed": 0, "pooled": 0}
        self.count_lock = threading.Lock()
        self.uid = iter(range(1 << 62))  # next() is atomic on a free-threaded build too
        self.uid_lock = threading.Lock()
        self.capsules = {}  # tag set -> the capsules handed out for it (one, always)
        self.capsule_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="pool")  # not alloc-*

    def bump(self, key, n=1):
        with self.count_lock:
            self.counts[key] += n

    def next_uid(self):
        with self.uid_lock:
            return next(self.uid)

    def capsule(self, tags):
        """datamem's handler for `tags`, noted (checked at the end)."""
        cap = _ext.handler(tags)
        with self.capsule_lock:
            self.capsules.setdefault(tags, []).append(cap)
        return cap

    def fail(self, what):
        self.errors.append("%s: %s" % (threading.current_thread().name, what))

    # ---- arrays ----------------------------------------------------------------

    def make(self, rng, tagged=False, alloc_thread=True, site_fn=None, site_match=False):
        """A checked array: (array, value, arenas it may be in)."""
        dtype = rng.choice((np.float64, np.float32, np.int64))
        n = rng.choice((3, 200, 1000, 5000, 20_000, 100_000))
        if rng.random() < 0.02:
            n = 5 * MIB // 8 + rng.randrange(100)
        value = self.next_uid() % (1 << 23)  # exact in float32
        a_first = self.a_in_force.is_set()
        if site_fn is None and rng.random() < 0.2:  # made in a pool thread
            def full():
                return self.pool.submit(np.full, n, value, dtype=dtype).result()
            alloc_thread = False
            self.bump("pooled")
        else:
            def full():
                return np.full(n, value, dtype=dtype)
        if site_fn is not None:
            arr = site_fn(n, value, dtype)
        elif tagged:
            with datamem.tag("hot"):
                arr = full()
        else:
            arr = full()
        nbytes = arr.nbytes
        want = {expected(nbytes, dtype, tagged, site_match, alloc_thread, True)}
        if not a_first:  # made while the start policy may still be in force
            want.add(expected(nbytes, dtype, tagged, site_match, alloc_thread, False))
        self.bump("arrays")
        item = (arr, value, want)
        self.check(item)
        return item

    def check(self, item):
        arr, value, want = item
        got = datamem.arena_of(arr)
        if got not in want:
            self.fail("array of %d bytes (%s) in arena %r, expected %s"
                      % (arr.nbytes, arr.dtype, got, sorted(want)))
        if not (arr[0] == value and arr[-1] == value and arr.min() == value
                and arr.max() == value):
            self.fail("array of %d bytes lost its contents %r" % (arr.nbytes, value))
        self.bump("checked")

    def hand_over(self, rng, item, held):
        q = self.queues[rng.randrange(self.nalloc)]
        try:
            q.put_nowait(item)
            self.bump("handed")
        except queue.Full:
            held.append(item)

    # ---- threads ---------------------------------------------------------------

    def allocator(self, k):
        rng = random.Random(1000 + k)
        held = []
        mine = self.queues[k]
        self.go.wait()
        for _ in range(self.iters * 4):
            item = self.make(rng, tagged=rng.random() < 0.1)
            if rng.random() < 0.7:
                self.hand_over(rng, item, held)
            else:
                held.append(item)
            while True:  # what others handed over: checked and freed here
                try:
                    self.check(mine.get_nowait())
                except queue.Empty:
                    break
            while len(held) > 4:
                self.check(held.pop(0))
        self.finish(held, mine)

    def mutator(self, k):
        rng = random.Random(k)
        held = []
        self.go.wait()
        for r in range(STORM):  # every mutator asks for the same new tag set at once
            self.round.wait()
            self.capsule(("hot", "fresh%d" % r))
        if k < 4 or rng.random() < 0.5:  # many installs of a dtype policy at once
            self.install("A")
        for i in range(self.iters):
            op = rng.randrange(9)
            if op == 0:
                self.install(rng.choice("AB"))
            elif op == 1:
                datamem.reload(self.paths[rng.choice("AB")] if rng.random() < 0.5 else None)
                self.bump("reloads")
            elif op == 2:
                extra = ("x%d" % rng.randrange(16),) if rng.random() < 0.5 else ()
                with datamem.tag(*extra):  # new tag sets: new handlers, made at once
                    self.capsule(tuple(_ext.handler_tags(_ext.get_handler())) + ("hot",))
                    held.append(self.make(rng, tagged=True, alloc_thread=False))
                self.bump("tags")
            elif op == 3:
                self.explain(rng)
            elif op == 4:
                self.read_stats()
            elif op == 5:
                self.profile(k, i)
            elif op in (6, 7):
                held.append(self.site(rng))
            else:
                held.append(self.make(rng, alloc_thread=False))
            if len(held) > 3:
                self.hand_over(rng, held.pop(0), held)
            while len(held) > 6:
                self.check(held.pop(0))
        self.finish(held, None)

    def finish(self, held, mine):
        self.done.wait()  # every thread has stopped making arrays
        if mine is not None:
            while True:
                try:
                    held.append(mine.get_nowait())
                except queue.Empty:
                    break
        self.held[threading.current_thread().name] = held

    # ---- what the mutators do --------------------------------------------------

    def install(self, which):
        datamem.install(self.paths[which])
        self.bump("installs")
        if which == "A":
            self.a_in_force.set()

    def explain(self, rng):
        tags = ["x%d" % rng.randrange(16)] + (["hot"] if rng.random() < 0.5 else [])
        text = datamem.explain(self.paths[rng.choice("AB")], 2048, "float32", "alloc-1", tags)
        want = ("-> rule 'hot' -> arena 'tagged'" if "hot" in tags
                else "-> rule 'f32' -> arena 'f32'")
        if want not in text:
            self.fail("explain for tags %r said %r" % (tags, text))
        self.bump("explains")

    def read_stats(self):
        a_first = self.a_in_force.is_set()  # before the snapshot, which must then show A's
        s = datamem.stats()
        if a_first and not set(OURS) <= set(s["arenas"]):
            self.fail("stats() after A's install lacks arenas: %r" % sorted(s["arenas"]))
        if datamem.current_policy() not in (self.paths["A"], self.paths["B"], self.paths["start"]):
            self.fail("current_policy() is %r" % datamem.current_policy())
        self.bump("stats")

    def profile(self, k, i):
        d = os.path.join(self.dir, "prof-%d-%d" % (k, i))
        try:
            path = _ext.profile_start(d, 64 * KIB, False, False, '"race": 1')
        except RuntimeError as e:
            if "already recording" not in str(e):
                self.fail("profile_start: %s" % e)
            self.bump("profile_refusals")
            return
        if not path.startswith(d):
            self.fail("profile_start gave %r for %r" % (path, d))
        self.bump("profiles")
        _ext.profile_stop()

    def site(self, rng):
        """A new code object: its call-site entry is made now, by this thread."""
        uid = self.next_uid()
        matching = rng.random() < 0.8
        name = ("site_fn_%d" if matching else "other_fn_%d") % uid
        g = {"__name__": "sitemod", "np": np}
        exec("def %s(n, v, dt):\n    return np.full(n, v, dtype=dt)\n" % name, g)
        self.bump("sites")
        return self.make(rng, alloc_thread=False, site_fn=g[name], site_match=matching)


def live(names):
    arenas = datamem.stats()["arenas"]
    return {n: arenas[n]["allocations"] - arenas[n]["frees"] if n in arenas else 0
            for n in names}


def main():
    d, nmut, nalloc, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    r = Race(d, nmut, nalloc, iters)
    datamem.install(r.paths["start"])
    base = live(OURS)
    threads = [threading.Thread(target=r.mutator, args=(k,), name="mut-%d" % k)
               for k in range(nmut)]
    threads += [threading.Thread(target=r.allocator, args=(k,), name="alloc-%d" % k)
                for k in range(nalloc)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    r.go.wait()
    r.done.wait()
    for t in threads:
        t.join()
    r.pool.shutdown()
    took = time.monotonic() - t0
    held = [item for items in r.held.values() for item in items]
    r.held.clear()
    item = None
    for item in held:
        r.check(item)
    del item  # the loop's last array
    now = live(OURS)
    want = {n: base[n] + sum(1 for it in held if datamem.arena_of(it[0]) == n) for n in OURS}
    if now != want:
        r.fail("live arrays per arena %r, held %r" % (now, want))
    held.clear()
    for tags, caps in sorted(r.capsules.items()):
        # Each capsule asked for must carry its tag set. How many capsules one
        # tag set gets is not pinned: the handler cache is direct-mapped (the
        # last 128 tag sets), and another thread's tag set landing in the same
        # slot pushes a capsule out while arrays (here, the mutators) still
        # hold it, so the next ask makes another. Two threads asking at once
        # get one (a second look under the handlers' mutex, handler.c).
        for c in caps:
            if sorted(_ext.handler_tags(c)) != sorted(tags):
                r.fail("tag set %r: a handler for %r" % (tags, _ext.handler_tags(c)))
    r.capsules.clear()
    if not all(q.empty() for q in r.queues):
        r.fail("arrays left in the hand-over queues")
    after = live(OURS)
    if after != base:
        r.fail("after freeing everything, live arrays per arena %r, expected %r" % (after, base))
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    print(json.dumps({"errors": r.errors[:20], "nerrors": len(r.errors), "counts": r.counts,
                      "seconds": round(took, 2), "gil": gil}))
    sys.exit(1 if r.errors else 0)


if __name__ == "__main__":
    main()
