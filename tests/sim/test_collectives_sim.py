"""Correctness of every collective on the simulator backend, against the numpy
references of tests/reference.py.

Every case draws fresh random inputs (never zeros), poisons every output with a
sentinel (NaN for floats, 77 for integers) so that unwritten elements show up,
checks that out-of-place inputs are left untouched and that reduce() leaves
the non-root outputs alone.  Copies (all_gather, broadcast) must be exact byte
for byte; integer reductions exact; float reductions within
reference.tolerance; all_reduce outputs identical byte for byte on every rank.

Communicators are made once per (path, device layout) for the module.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import dfccl
from reference import DTYPES, KINDS, OPS, assert_close, random_input, reduce

PATHS = ("direct", "ring")
DEV = 1000                      # device ids of this module: 1000..1199
TIMEOUT = 30.0
BF16 = "bfloat16"
ALL_DTYPES = DTYPES + (BF16,)
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
SIZES = (1, 2, 3, 7, 15, 16, 17, 1000, 4099, 65537)


# -- bfloat16 helpers (bf16 = upper 16 bits of a float32, round to nearest even) ---
def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), r)


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def test_bf16_helpers_round_to_nearest_even():
    # 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0);
    # 1 + 3*2^-8 is halfway too and goes up to the even 1 + 2^-6.
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.5], np.float32)
    got = bf16_to_f32(f32_to_bf16(x))
    assert got.dtype == np.float32
    assert got.tolist() == [1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -2.5]
    assert f32_to_bf16(np.array([1.0], np.float32))[0] == 0x3F80
    assert f32_to_bf16(np.array([np.nan], np.float32))[0] & 0x7FC0 == 0x7FC0


# -- communicators -------------------------------------------------------------------
class _Comms:
    """Communicators per (path, devices), made on first use, closed at the end.
    A case that fails drops its communicators so that later cases start clean."""

    def __init__(self):
        self._cache: dict = {}

    def get(self, path: str, devices) -> list:
        key = (path, tuple(devices))
        comms = self._cache.get(key)
        if comms is None:
            comms = dfccl.Communicator.for_devices(list(devices), backend="sim",
                                                   options=dfccl.CommOptions(path=path))
            assert [c.rank for c in comms] == list(range(len(devices)))
            assert all(c.world_size == len(devices) and c.path == path for c in comms)
            self._cache[key] = comms
        return comms

    def drop(self, comms) -> None:
        for key, value in list(self._cache.items()):
            if value is comms:
                del self._cache[key]
                for c in comms:
                    c.abort()

    def wait_all(self, comms, works) -> None:
        """Synchronizes every work; drops ``comms`` if one fails or times out."""
        try:
            for w in works:
                w.synchronize(timeout=TIMEOUT)
        except BaseException:
            self.drop(comms)
            raise

    def close(self):
        for comms in self._cache.values():
            for c in comms:
                c.close()
        self._cache.clear()


@pytest.fixture(scope="module")
def comms_for():
    pool = _Comms()
    yield pool
    pool.close()


def distinct(n: int) -> tuple:
    """Rank i on its own simulated GPU."""
    return tuple(DEV + i for i in range(n))


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# -- one case --------------------------------------------------------------------------
def _sentinel(dtype: str):
    if dtype == BF16:
        return np.uint16(0x7FC0)                     # bf16 NaN
    dt = np.dtype(dtype)
    return dt.type(np.nan) if dt.kind == "f" else dt.type(77)


def _storage(dtype: str):
    return np.uint16 if dtype == BF16 else np.dtype(dtype)


def _poisoned(dtype: str, count: int) -> np.ndarray:
    return np.full(count, _sentinel(dtype), dtype=_storage(dtype))


def _inputs(rng, dtype: str, count: int, op: str) -> np.ndarray:
    if dtype == BF16:
        x = random_input(rng, "float32", count, op)
        return f32_to_bf16(x)
    x = random_input(rng, dtype, count, op)
    if count and not np.any(x):
        x[0] = 1   # never all zeros
    return x


def _wrap(arr: np.ndarray, dtype: str):
    if dtype != BF16:
        return arr
    assert arr.dtype == np.uint16 and arr.flags.c_contiguous
    return dfccl.Buffer.from_pointer(arr.ctypes.data, arr.size, BF16, owner=arr)


def _bf16_check(got_bits: np.ndarray, inputs: list, op: str, what: str) -> None:
    """bf16 reductions: the daemon accumulates in float32 and rounds to bf16 once
    per step (one step per rank on the ring).  Error bound: one bf16 rounding
    (2^-8 relative, generously) per rank, over the sum of magnitudes."""
    n = len(inputs)
    xs = np.stack([bf16_to_f32(x).astype(np.float64) for x in inputs])
    got = bf16_to_f32(got_bits).astype(np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten elements?)"
    if op in ("min", "max"):
        want = xs.min(axis=0) if op == "min" else xs.max(axis=0)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{what}: {bad.size} wrong, first at {bad[0]}: got {got[bad[0]]} want {want[bad[0]]}"
        return
    if op == "prod":
        want = np.prod(xs, axis=0)
        mag = np.abs(want)
    else:
        want = xs.sum(axis=0)
        mag = np.abs(xs).sum(axis=0)
        if op == "avg":
            want, mag = want / n, mag / n
    bound = (n + 1) * 2.0**-8 * mag + 1e-30
    err = np.abs(got - want)
    worst = int(np.argmax(err / bound))
    assert np.all(err <= bound), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(got {got[worst]}, want {want[worst]})")


def _check_reduced(got, inputs, dtype, op, what):
    if dtype == BF16:
        _bf16_check(got, inputs, op, what)
    else:
        assert_close(got, reduce(inputs, op), dtype, op, len(inputs), what)


def _same_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.tobytes() != want.tobytes():
        g = got.view(np.uint8).reshape(got.size, -1)
        w = want.view(np.uint8).reshape(want.size, -1)
        bad = np.flatnonzero(np.any(g != w, axis=1))
        raise AssertionError(f"{what}: {bad.size} of {got.size} elements differ, first at {bad[0]}: "
                             f"got {got[bad[0]]!r}, want {want[bad[0]]!r}")


def run_case(comms, kind: str, dtype: str, count: int, *, op: str = "sum", root: int = 0, in_place=False,
             seed: int = 0, tag=None) -> list:
    """Runs one collective on every rank of ``comms`` and checks it.

    ``in_place``: False, True, or a per-rank list of booleans (mixed forms).
    Returns the output arrays (for extra checks)."""
    n = len(comms)
    rng = np.random.default_rng(seed)
    modes = list(in_place) if isinstance(in_place, (list, tuple)) else [bool(in_place)] * n
    send_count = count * n if kind == "reduce_scatter" else count
    inputs = [_inputs(rng, dtype, send_count, op) for _ in range(n)]
    originals = [x.copy() for x in inputs]

    sends, recvs, outs = [], [], []  # what we pass, and the array holding each rank's result
    for r in range(n):
        ip = modes[r]
        x = inputs[r].copy()
        if kind == "all_reduce":
            recv = None if ip else _poisoned(dtype, count)
            sends.append(x)
            recvs.append(recv)
            outs.append(x if ip else recv)
        elif kind == "all_gather":
            out = _poisoned(dtype, count * n)
            if ip:
                out[r * count:(r + 1) * count] = x
                sends.append(out[r * count:(r + 1) * count])
            else:
                sends.append(x)
            recvs.append(out)
            outs.append(out)
        elif kind == "reduce_scatter":
            sends.append(x)
            recv = x[r * count:(r + 1) * count] if ip else _poisoned(dtype, count)
            recvs.append(recv)
            outs.append(recv)
        elif kind == "broadcast":
            if ip:
                if r != root:
                    x = _poisoned(dtype, count)       # in place: the non-root buffer is only written
                sends.append(x)
                recvs.append(None)
                outs.append(x)
            else:
                recv = _poisoned(dtype, count)
                sends.append(x)
                recvs.append(recv)
                outs.append(recv)
        else:  # reduce
            recv = None if ip else _poisoned(dtype, count)
            sends.append(x)
            recvs.append(recv)
            outs.append(x if ip else recv)

    works = [None] * n
    for r in rng.permutation(n):  # ranks submit in any order
        c, s, rv = comms[r], _wrap(sends[r], dtype), None if recvs[r] is None else _wrap(recvs[r], dtype)
        kw = {} if tag is None else {"tag": tag}
        if kind == "all_reduce":
            works[r] = c.all_reduce(s, rv, op=op, **kw)
        elif kind == "all_gather":
            works[r] = c.all_gather(s, rv, **kw)
        elif kind == "reduce_scatter":
            works[r] = c.reduce_scatter(s, rv, op=op, **kw)
        elif kind == "broadcast":
            works[r] = c.broadcast(s, rv, root=root, **kw)
        else:
            works[r] = c.reduce(s, rv, op=op, root=root, **kw)
    for r, w in enumerate(works):
        w.synchronize(timeout=TIMEOUT)
        assert w.done() and w.exception() is None, f"rank {r}: {w.exception()!r}"

    what = f"{kind} {dtype} op={op} n={n} count={count} root={root} in_place={modes}"
    for r in range(n):
        # Inputs of the out-of-place forms must be left alone.
        if not modes[r]:
            _same_bytes(sends[r], originals[r], f"{what}: rank {r} send buffer was modified")
    if kind == "all_reduce":
        for r in range(n):
            _check_reduced(outs[r], originals, dtype, op, f"{what}: rank {r}")
        for r in range(1, n):
            _same_bytes(outs[r], outs[0], f"{what}: rank {r} output differs from rank 0's (not bit-identical)")
    elif kind == "all_gather":
        want = np.concatenate(originals)
        for r in range(n):
            _same_bytes(outs[r], want, f"{what}: rank {r}")
    elif kind == "reduce_scatter":
        for r in range(n):
            _check_reduced(outs[r], [x[r * count:(r + 1) * count] for x in originals], dtype, op, f"{what}: rank {r}")
        for r in range(n):
            if modes[r]:  # in place: the rest of send is not written by the collective
                rest = np.concatenate([sends[r][:r * count], sends[r][(r + 1) * count:]])
                orig = np.concatenate([originals[r][:r * count], originals[r][(r + 1) * count:]])
                _same_bytes(rest, orig, f"{what}: rank {r} in-place send outside its slice was modified")
    elif kind == "broadcast":
        for r in range(n):
            _same_bytes(outs[r], originals[root], f"{what}: rank {r}")
    else:
        _check_reduced(outs[root], originals, dtype, op, f"{what}: root {root}")
        for r in range(n):
            if r == root:
                continue
            if modes[r]:
                _same_bytes(outs[r], originals[r], f"{what}: non-root rank {r}'s in-place buffer was written")
            else:
                _same_bytes(outs[r], _poisoned(dtype, count), f"{what}: non-root rank {r}'s recv was written")
    for w in works:
        st = w.stats
        assert st is not None and 1 <= st["channels"] <= 32, f"{what}: stats {st}"
    return outs


def checked(pool: _Comms, comms, *args, **kwargs):
    """run_case, dropping the communicators when the case fails (a collective
    left pending must not disturb the next case)."""
    try:
        return run_case(comms, *args, **kwargs)
    except BaseException:
        pool.drop(comms)
        raise


# -- 1. every kind x every size, float32 sum, both paths, nranks 1..8 ----------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nranks", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("in_place", (False, True), ids=("out", "inplace"))
def test_sizes_float32(comms_for, path, nranks, kind, count, in_place):
    comms = comms_for.get(path, distinct(nranks))
    root = (count % nranks) if kind in ("broadcast", "reduce") else 0
    checked(comms_for, comms, kind, "float32", count, root=root, in_place=in_place,
            seed=seed_of("sizes", path, nranks, kind, count, in_place))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kind", ("all_reduce", "all_gather", "reduce_scatter"))
@pytest.mark.parametrize("count", (1, 3, 15, 17, 65537))
def test_sizes_every_dtype(comms_for, path, dtype, kind, count):
    """Odd sizes for every element size: the daemon cuts parts on 16-byte packs."""
    comms = comms_for.get(path, distinct(3))
    checked(comms_for, comms, kind, dtype, count, op="max" if count == 15 else "sum", in_place=(count == 17),
            seed=seed_of("sizes-dtype", path, dtype, kind, count))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", (1000, 4099))
@pytest.mark.parametrize("in_place", (False, True))
def test_sizes_float32_both_forms(comms_for, path, kind, count, in_place):
    comms = comms_for.get(path, distinct(3))
    checked(comms_for, comms, kind, "float32", count, root=2, in_place=in_place,
            seed=seed_of("forms", path, kind, count, in_place))


# -- 2. every dtype, sum (and copies), both paths ---------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nranks,count,in_place", [(2, 4099, False), (3, 17, True), (4, 1000, False)])
def test_dtypes(comms_for, path, dtype, kind, nranks, count, in_place):
    comms = comms_for.get(path, distinct(nranks))
    checked(comms_for, comms, kind, dtype, count, root=nranks - 1, in_place=in_place,
            seed=seed_of("dtypes", path, dtype, kind, nranks, count))


# -- 3. every op x every dtype, the reducing kinds ---------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kind", REDUCING)
@pytest.mark.parametrize("nranks,count,in_place", [(3, 1031, False), (4, 4099, True)])
def test_ops(comms_for, path, op, dtype, kind, nranks, count, in_place):
    comms = comms_for.get(path, distinct(nranks))
    checked(comms_for, comms, kind, dtype, count, op=op, root=nranks - 2, in_place=in_place,
            seed=seed_of("ops", path, op, dtype, kind, nranks))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ("int8", "uint8", "int32", "uint64", "int64", "float16", "float64", BF16))
@pytest.mark.parametrize("nranks", (2, 8))
def test_ops_all_reduce_nranks(comms_for, path, op, dtype, nranks):
    """AVG divides once by n (C division for integers); PROD and SUM wrap."""
    comms = comms_for.get(path, distinct(nranks))
    checked(comms_for, comms, "all_reduce", dtype, 4099, op=op, in_place=(nranks == 8),
            seed=seed_of("ops-n", path, op, dtype, nranks))


# -- 4. roots ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ("broadcast", "reduce"))
@pytest.mark.parametrize("nranks", (2, 3, 4, 8))
@pytest.mark.parametrize("in_place", (False, True))
def test_every_root(comms_for, path, kind, nranks, in_place):
    comms = comms_for.get(path, distinct(nranks))
    for root in range(nranks):
        checked(comms_for, comms, kind, "int32", 1000 + root, op="max" if kind == "reduce" else "sum", root=root,
                in_place=in_place, seed=seed_of("roots", path, kind, nranks, root, in_place),
                tag=("root", kind, root, int(in_place)))


# -- 5. several ranks on one simulated GPU -------------------------------------------------
LAYOUTS = {
    "2x2": (DEV + 100, DEV + 100, DEV + 101, DEV + 101),
    "3x1": (DEV + 110,) * 3,
    "mixed": (DEV + 120, DEV + 121, DEV + 120, DEV + 122, DEV + 121),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", (7, 4099, 65537))
def test_shared_devices(comms_for, path, layout, kind, count):
    devices = LAYOUTS[layout]
    comms = comms_for.get(path, devices)
    assert [c.device for c in comms] == list(devices)
    checked(comms_for, comms, kind, "float32" if count != 7 else "int64", count, root=len(devices) - 1,
            in_place=(count == 4099), seed=seed_of("shared", path, layout, kind, count))


# -- 6. sixteen ranks --------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", (1, 17, 4099))
def test_sixteen_ranks(comms_for, path, kind, count):
    comms = comms_for.get(path, distinct(16))
    checked(comms_for, comms, kind, "float32" if count != 17 else "int32", count, root=11,
            in_place=(count == 17), seed=seed_of("16", path, kind, count))


# -- 7. one large case (~1M elements, 4 MiB of float32 per buffer) --------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_large(comms_for, path, kind):
    n = 4
    count = (1 << 20) + 5 if kind not in ("all_gather", "reduce_scatter") else (1 << 18) + 3
    comms = comms_for.get(path, distinct(n))
    checked(comms_for, comms, kind, "float32", count, root=3, in_place=(kind == "all_reduce"),
            seed=seed_of("large", path, kind))


@pytest.mark.parametrize("path", PATHS)
def test_large_all_reduce_out_of_place_bit_identical(comms_for, path):
    comms = comms_for.get(path, distinct(4))
    outs = checked(comms_for, comms, "all_reduce", "float32", 1 << 20, op="sum",
                   seed=seed_of("large-bits", path))
    assert outs[0].nbytes == 4 << 20


# -- 8. bit-identical float all_reduce across ranks, every float dtype and op ----------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ("float16", "float32", "float64", BF16))
@pytest.mark.parametrize("op", ("sum", "avg", "prod"))
@pytest.mark.parametrize("nranks,count", [(3, 65537), (4, 15), (8, 4099)])
def test_all_reduce_bit_identical(comms_for, path, dtype, op, nranks, count):
    # run_case compares every rank's output with rank 0's byte for byte.
    comms = comms_for.get(path, distinct(nranks))
    outs = checked(comms_for, comms, "all_reduce", dtype, count, op=op, in_place=(count == 15),
                   seed=seed_of("bits", path, dtype, op, nranks, count))
    assert len({o.tobytes() for o in outs}) == 1


# -- 9. mixed forms: some ranks in place, the others not ---------------------------------------------
# Small direct all-reduces are eligible for one phase; the daemon takes it only
# when every rank is out of place (it learns that while meeting the peers).
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", (17, 65537))
def test_mixed_in_place_and_out_of_place(comms_for, path, kind, count):
    comms = comms_for.get(path, distinct(3))
    checked(comms_for, comms, kind, "float32", count, root=1, in_place=[True, False, True],
            seed=seed_of("mixed", path, kind, count))


# -- 10. tags and untagged collectives interleaved, many in flight ----------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_many_in_flight_any_order(comms_for, path):
    """Eight collectives of different kinds in flight at once; each rank submits
    them in its own order (tagged), then waits for all."""
    n = 4
    comms = comms_for.get(path, distinct(n))
    rng = np.random.default_rng(seed_of("inflight", path))
    count = 1003
    xs = {(k, r): random_input(rng, "int32", count * n, "sum") for k in range(8) for r in range(n)}
    outs = {(k, r): np.full(count * n, 77, np.int32) for k in range(8) for r in range(n)}
    works = []
    for r in range(n):
        for k in rng.permutation(8):
            kind = KINDS[k % 5]
            x, o = xs[(k, r)], outs[(k, r)]
            c = comms[r]
            tag = ("inflight", int(k))
            if kind == "all_reduce":
                w = c.all_reduce(x, o, tag=tag)
            elif kind == "all_gather":
                w = c.all_gather(x[:count], o, tag=tag)
            elif kind == "reduce_scatter":
                w = c.reduce_scatter(x, o[:count], tag=tag)
            elif kind == "broadcast":
                w = c.broadcast(x, o, root=int(k) % n, tag=tag)
            else:
                w = c.reduce(x, o, root=int(k) % n, tag=tag)
            works.append(w)
    comms_for.wait_all(comms, works)
    for k in range(8):
        kind = KINDS[k % 5]
        ins = [xs[(k, r)] for r in range(n)]
        for r in range(n):
            o = outs[(k, r)]
            if kind == "all_reduce":
                np.testing.assert_array_equal(o, reduce(ins, "sum"), err_msg=f"{kind} tag {k} rank {r}")
            elif kind == "all_gather":
                np.testing.assert_array_equal(o, np.concatenate([x[:count] for x in ins]),
                                              err_msg=f"{kind} tag {k} rank {r}")
            elif kind == "reduce_scatter":
                np.testing.assert_array_equal(o[:count], reduce([x[r * count:(r + 1) * count] for x in ins], "sum"),
                                              err_msg=f"{kind} tag {k} rank {r}")
                assert np.all(o[count:] == 77), f"{kind} tag {k} rank {r}: wrote past recv"
            elif kind == "broadcast":
                np.testing.assert_array_equal(o, ins[k % n], err_msg=f"{kind} tag {k} rank {r}")
            elif r == k % n:
                np.testing.assert_array_equal(o, reduce(ins, "sum"), err_msg=f"{kind} tag {k} rank {r}")
            else:
                assert np.all(o == 77), f"reduce tag {k}: non-root rank {r}'s recv was written"


# -- 11. plans: the same results as the one-off calls, reused many times --------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_plans_reused(comms_for, path, kind):
    n = 3
    comms = comms_for.get(path, distinct(n))
    count = 2049
    tag = ("plan", kind)
    plans = []
    for c in comms:
        if kind == "all_reduce":
            plans.append(c.prepare_all_reduce(count, "int64", op="sum", tag=tag))
        elif kind == "all_gather":
            plans.append(c.prepare_all_gather(count, "int64", tag=tag))
        elif kind == "reduce_scatter":
            plans.append(c.prepare_reduce_scatter(count, "int64", op="max", tag=tag))
        elif kind == "broadcast":
            plans.append(c.prepare_broadcast(count, "int64", root=2, tag=tag))
        else:
            plans.append(c.prepare_reduce(count, "int64", op="min", root=1, tag=tag))
    rng = np.random.default_rng(seed_of("plans", path, kind))
    for it in range(4):
        ins = [random_input(rng, "int64", count * (n if kind == "reduce_scatter" else 1), "sum") for _ in range(n)]
        outs = [np.full(count * (n if kind == "all_gather" else 1), 77, np.int64) for _ in range(n)]
        works = []
        for r in rng.permutation(n):
            works.append(plans[r](ins[r], outs[r]))
        comms_for.wait_all(comms, works)
        for r in range(n):
            what = f"plan {kind} call {it} rank {r}"
            if kind == "all_reduce":
                np.testing.assert_array_equal(outs[r], reduce(ins, "sum"), err_msg=what)
            elif kind == "all_gather":
                np.testing.assert_array_equal(outs[r], np.concatenate(ins), err_msg=what)
            elif kind == "reduce_scatter":
                np.testing.assert_array_equal(outs[r], reduce([x[r * count:(r + 1) * count] for x in ins], "max"),
                                              err_msg=what)
            elif kind == "broadcast":
                np.testing.assert_array_equal(outs[r], ins[2], err_msg=what)
            elif r == 1:
                np.testing.assert_array_equal(outs[r], reduce(ins, "min"), err_msg=what)
            else:
                assert np.all(outs[r] == 77), f"{what}: non-root recv written"


# -- 12. options that change the geometry ----------------------------------------------------------------------
GEOMETRY_OPTIONS = {
    "1channel": dict(channels=1),
    "tiny-slices": dict(max_slice_bytes=256, ring_slots=2, bytes_per_channel=4096),
    "two-slots": dict(ring_slots=2, max_slice_bytes=512),
    "no-one-shot": dict(one_shot_bytes=0),
    "all-one-shot": dict(one_shot_bytes=1 << 30),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("opt", sorted(GEOMETRY_OPTIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_geometry_options(comms_for, path, opt, kind):
    key = (path, "opt", opt)
    comms = comms_for._cache.get(key)
    if comms is None:
        comms = dfccl.Communicator.for_devices(list(distinct(3)), backend="sim",
                                               options=dfccl.CommOptions(path=path, **GEOMETRY_OPTIONS[opt]))
        comms_for._cache[key] = comms
    for count, in_place in ((5, False), (12345, True), (12347, False)):
        checked(comms_for, comms, kind, "float32", count, root=2, in_place=in_place,
                seed=seed_of("geom", path, opt, kind, count))


# -- 13. more daemon blocks (channels) than the default, and devices with different block counts ------------------
@pytest.fixture(scope="module")
def many_channel_comms():
    """Devices with 5 and 3 daemon blocks; a communicator uses the fewest blocks
    of its ranks' daemons, shared out among ranks that share one ("5-blocks":
    ranks 0 and 2 share DEV + 150's daemon, 2 blocks each)."""
    made = [dfccl.Communicator.for_devices([DEV + 150], backend="sim",
                                           daemon_options=dfccl.DaemonOptions(blocks=5)),
            dfccl.Communicator.for_devices([DEV + 151], backend="sim",
                                           daemon_options=dfccl.DaemonOptions(blocks=5)),
            dfccl.Communicator.for_devices([DEV + 160], backend="sim",
                                           daemon_options=dfccl.DaemonOptions(blocks=3))]
    groups = {}
    for path in PATHS:
        opts = dfccl.CommOptions(path=path, bytes_per_channel=1024)
        groups[(path, "5-blocks")] = dfccl.Communicator.for_devices([DEV + 150, DEV + 151, DEV + 150],
                                                                    backend="sim", options=opts)
        groups[(path, "5+3-blocks")] = dfccl.Communicator.for_devices([DEV + 150, DEV + 160, DEV + 151],
                                                                      backend="sim", options=opts)
    yield groups
    for comms in list(groups.values()) + made:
        for c in comms:
            c.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", ("5-blocks", "5+3-blocks"))
@pytest.mark.parametrize("kind", KINDS)
def test_many_channels(many_channel_comms, path, group, kind):
    comms = many_channel_comms[(path, group)]
    want = 2 if group == "5-blocks" else 3
    assert all(c.channels == want for c in comms), [c.channels for c in comms]
    for count, dtype, in_place in ((9, "int8", False), (10007, "float32", True), (30011, "float64", False)):
        run_case(comms, kind, dtype, count, root=1, in_place=in_place,
                 seed=seed_of("channels", path, group, kind, count))
    # 30011 doubles with 1 KiB per channel use every channel.
    x = [np.ones(30011) for _ in comms]
    works = [c.all_reduce(v, tag="chan-count") for c, v in zip(comms, x)]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
        assert w.stats["channels"] == want, w.stats
    assert all(np.all(v == len(comms)) for v in x)


# -- 14. buffers that are not 16-byte aligned -------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ("int8", "float16", "float32", "float64"))
def test_unaligned_buffers(comms_for, path, kind, dtype):
    """Send at +1 element, recv at +3 elements of larger arrays: the daemon
    falls back to element-wise moves and must still fill exactly the range."""
    n = 3
    comms = comms_for.get(path, distinct(n))
    count = 1001
    rng = np.random.default_rng(seed_of("unaligned", path, kind, dtype))
    s_count = count * n if kind == "reduce_scatter" else count
    r_count = count * n if kind == "all_gather" else count
    sent, recv_full, ins = [], [], []
    works = []
    for r in range(n):
        s_full = np.full(s_count + 2, _sentinel(dtype), np.dtype(dtype))
        s_full[1:1 + s_count] = _inputs(rng, dtype, s_count, "sum")
        o_full = _poisoned(dtype, r_count + 6)
        sent.append(s_full)
        recv_full.append(o_full)
        ins.append(s_full[1:1 + s_count].copy())
    try:
        for r in range(n):
            c, s, o = comms[r], sent[r][1:1 + s_count], recv_full[r][3:3 + r_count]
            if kind == "all_reduce":
                works.append(c.all_reduce(s, o))
            elif kind == "all_gather":
                works.append(c.all_gather(s, o))
            elif kind == "reduce_scatter":
                works.append(c.reduce_scatter(s, o))
            elif kind == "broadcast":
                works.append(c.broadcast(s, o, root=2))
            else:
                works.append(c.reduce(s, o, root=2))
        for w in works:
            w.synchronize(timeout=TIMEOUT)
    except BaseException:
        comms_for.drop(comms)
        raise
    what = f"unaligned {kind} {dtype}"
    for r in range(n):
        o = recv_full[r]
        _same_bytes(np.concatenate([o[:3], o[3 + r_count:]]), _poisoned(dtype, 6), f"{what}: rank {r} wrote outside recv")
        got = o[3:3 + r_count]
        if kind == "all_reduce":
            assert_close(got, reduce(ins, "sum"), dtype, "sum", n, f"{what}: rank {r}")
        elif kind == "all_gather":
            _same_bytes(got, np.concatenate(ins), f"{what}: rank {r}")
        elif kind == "reduce_scatter":
            assert_close(got, reduce([x[r * count:(r + 1) * count] for x in ins], "sum"), dtype, "sum", n,
                         f"{what}: rank {r}")
        elif kind == "broadcast":
            _same_bytes(got, ins[2], f"{what}: rank {r}")
        elif r == 2:
            assert_close(got, reduce(ins, "sum"), dtype, "sum", n, f"{what}: root")
        else:
            _same_bytes(got, _poisoned(dtype, r_count), f"{what}: non-root rank {r} recv written")


def test_ring_slice_must_be_a_multiple_of_16(comms_for):
    """FIFO slots hold whole 16-byte packs: other slice sizes are rejected, and
    an unusual but valid one gives exact results."""
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.CommOptions(path="ring", max_slice_bytes=1000)
    opts = dfccl.CommOptions(path="ring", max_slice_bytes=1008)
    comms = dfccl.Communicator.for_devices(list(distinct(3)), backend="sim", options=opts)
    try:
        run_case(comms, "all_reduce", "float32", 100003, seed=seed_of("slice1008"))
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("kind", ("all_reduce", "all_gather"))
def test_ring_needs_two_fifo_slots(kind):
    """One FIFO slot would deadlock the ring (a receive-and-send step needs the
    next rank's slot free first): it is rejected; two slots work."""
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.CommOptions(path="ring", ring_slots=1)
    opts = dfccl.CommOptions(path="ring", ring_slots=2)
    n, count = 3, 64
    comms = dfccl.Communicator.for_devices(list(distinct(n)), backend="sim", options=opts)
    xs = [np.arange(count, dtype=np.float32) + r for r in range(n)]
    outs = [np.full(count * (n if kind == "all_gather" else 1), np.nan, np.float32) for _ in range(n)]
    works = [c.all_reduce(x, o) if kind == "all_reduce" else c.all_gather(x, o) for c, x, o in zip(comms, xs, outs)]
    try:
        for w in works:
            w.synchronize(timeout=1.0)  # a deadlock shows as CollectiveTimeoutError
        want = sum(xs) if kind == "all_reduce" else np.concatenate(xs)
        for o in outs:
            np.testing.assert_array_equal(o, want)
    finally:
        for c in comms:
            c.abort()
        for w in works:  # retire every work before close()
            try:
                w.synchronize(timeout=TIMEOUT)
            except dfccl.DfcclError:
                pass
        for c in comms:
            c.close()
