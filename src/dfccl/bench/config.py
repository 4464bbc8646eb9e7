"""What ``dfccl bench`` runs: its configuration, the cases (collective,
size, dtype) and how a result is checked and sized (nccl-tests' busbw)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["BenchConfig", "Case", "DTYPES", "KINDS", "OPS", "REDUCING", "ROOTED", "bus_factor", "case_seed",
           "case_sizes", "count_wrong", "format_size", "numpy_dtype", "parse_size"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
OPS = ("sum", "prod", "min", "max", "avg")
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str) -> int:
    """Bytes from "8", "64K", "1M", "2G" (powers of two; a trailing B is allowed)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        value = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 8, 64K, 1M, 2G)") from None
    if value < 1 or value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes >= 1")
    return int(value)


def format_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- configuration -------------------------------------------------------------------
@dataclass
class BenchConfig:
    kinds: list[str] = field(default_factory=lambda: ["all_reduce"])
    min_bytes: int = 32 << 20
    max_bytes: int = 32 << 20
    step_factor: int = 2
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    backend: str = "sim"
    devices: list[int] = field(default_factory=lambda: [0, 1])
    mode: str = "thread"
    path: str = "auto"
    out: str = "."
    nccl: bool = True
    plot: bool = True
    progress: bool = True
    seed: int | None = None
    blocking: bool = False
    floor: bool = True

    def validate(self) -> None:
        """ValueError with a one-line reason for anything the run would trip on."""
        for k in self.kinds:
            if k not in KINDS:
                raise ValueError(f"unknown collective {k!r} (one of {', '.join(KINDS)} or all)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (one of {', '.join(DTYPES)})")
        numpy_dtype(self.dtype)
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r} (one of {', '.join(OPS)})")
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"minbytes {self.min_bytes} is above maxbytes {self.max_bytes}")
        if self.step_factor < 2 and self.min_bytes != self.max_bytes:
            raise ValueError("stepfactor must be at least 2")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup_iters >= 0")
        if len(self.devices) < 2:
            raise ValueError(f"needs at least two ranks, got devices {self.devices}")
        if not 0 <= self.root < len(self.devices):
            raise ValueError(f"root {self.root} is outside 0..{len(self.devices) - 1}")
        if self.mode not in ("thread", "process"):
            raise ValueError(f"mode must be thread or process, not {self.mode!r}")
        if self.mode == "process" and self.path == "direct":
            raise ValueError("path 'direct' needs every rank in one process: use --mode thread")


# -- one (collective, size) ----------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """Buffers and reference of one collective at one size on ``n`` ranks.
    ``count`` follows the Communicator.prepare_* convention (per rank for
    all_gather / reduce_scatter)."""

    kind: str
    dtype: str
    op: str
    root: int
    n: int
    count: int

    @classmethod
    def for_size(cls, kind: str, size: int, n: int, dtype: str, op: str, root: int) -> "Case":
        esize = numpy_dtype(dtype).itemsize
        per_rank = kind in ("all_gather", "reduce_scatter")
        count = max(1, size // esize // (n if per_rank else 1))
        return cls(kind, dtype, op if kind in REDUCING else "sum", root if kind in ROOTED else -1, n, count)

    @property
    def in_count(self) -> int:
        return self.count * (self.n if self.kind == "reduce_scatter" else 1)

    @property
    def out_count(self) -> int:
        return self.count * (self.n if self.kind == "all_gather" else 1)

    @property
    def total_count(self) -> int:
        """nccl-tests' count: elements of the larger buffer."""
        return max(self.in_count, self.out_count)

    @property
    def nbytes(self) -> int:
        return self.total_count * numpy_dtype(self.dtype).itemsize

    @property
    def redop(self) -> str:
        return self.op if self.kind in REDUCING else "none"

    def inputs(self, seed) -> list[np.ndarray]:
        """Every rank's input, the same in every process that asks (seeded), never all zeros."""
        from dfccl import scenarios as sc

        rng = np.random.default_rng(seed)
        if self.dtype == "bfloat16":
            src = "float32"
            return [sc.random_input(rng, src, self.in_count, self.op).astype(numpy_dtype("bfloat16"))
                    for _ in range(self.n)]
        return [sc.random_input(rng, self.dtype, self.in_count, self.op) for _ in range(self.n)]

    def expected(self, inputs: list[np.ndarray], rank: int) -> np.ndarray | None:
        """What rank's output must hold; None where nothing is checked (non-root of reduce)."""
        from dfccl import scenarios as sc

        if self.kind == "all_gather":
            return np.concatenate(inputs)
        if self.kind == "broadcast":
            return inputs[self.root]
        if self.kind == "reduce" and rank != self.root:
            return None
        if self.dtype == "bfloat16":
            # dfccl and NCCL accumulate bfloat16 in float32.
            total = sc.reduce_reference([a.astype(np.float32) for a in inputs], self.op).astype(inputs[0].dtype)
        else:
            total = sc.reduce_reference(inputs, self.op)
        if self.kind == "reduce_scatter":
            return total[rank * self.count:(rank + 1) * self.count]
        return total

    def initial(self, inputs: list[np.ndarray], rank: int, in_place: bool,
                want: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(send contents, recv contents) before the checked run.  Out of place,
        recv is poisoned: NaN for floats, the bitwise complement of the
        expected value for integers (so an unwritten element never passes).
        In place, the single buffer (all_gather: the output) is returned as
        send and recv is None."""
        x = inputs[rank]
        if not in_place:
            return x, self._poison(want, self.out_count)
        if self.kind == "all_gather":
            full = self._poison(want, self.out_count)
            full[rank * self.count:(rank + 1) * self.count] = x
            return full, None
        return x, None

    def _poison(self, want: np.ndarray | None, count: int) -> np.ndarray:
        dt = numpy_dtype(self.dtype)
        if dt.kind in "iu" and want is not None and want.size == count:
            return np.invert(want)
        if dt.kind in "iu":
            return np.full(count, np.iinfo(dt).max, dtype=dt)
        return np.full(count, np.nan, dtype=np.float32).astype(dt)

    def in_place_views(self, buf, rank: int, mem):
        """(send, recv) views of one buffer in NCCL's in-place forms
        (``mem``: the harness's Memory, which cuts the views)."""
        c = self.count
        if self.kind == "all_gather":
            return mem.view(buf, rank * c, (rank + 1) * c), buf
        if self.kind == "reduce_scatter":
            return buf, mem.view(buf, rank * c, (rank + 1) * c)
        return buf, buf


def count_wrong(got: np.ndarray, want: np.ndarray | None, dtype: str, op: str, n: int) -> int:
    """Elements off the reference: integers exactly, floats within the
    tolerance of dfccl's tests; NaN and infinities are always wrong."""
    if want is None:
        return 0
    from dfccl import scenarios as sc

    if numpy_dtype(dtype).kind in "iu":
        return int(np.count_nonzero(got != want))
    tol = 2e-2 * max(1, n) if dtype == "bfloat16" else sc.tolerance(dtype, op, n)
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(g) | (np.abs(g - w) / (np.abs(w) + 1.0) > tol)
    return int(np.count_nonzero(bad))


def case_sizes(cfg: BenchConfig, kind: str) -> list[Case]:
    """The sweep of one collective, without sizes that round to the same buffer."""
    cases: list[Case] = []
    size = cfg.min_bytes
    while size <= cfg.max_bytes:
        c = Case.for_size(kind, size, len(cfg.devices), cfg.dtype, cfg.op, cfg.root)
        if not cases or cases[-1].count != c.count:
            cases.append(c)
        if cfg.step_factor < 2:
            break
        size *= cfg.step_factor
    return cases


def case_seed(base: int, kind: str, case: Case, placement: str) -> np.random.SeedSequence:
    """The same in every worker process (str hashes are salted per process: not used)."""
    return np.random.SeedSequence([base, KINDS.index(kind), case.count, ("oop", "ip", "nccl").index(placement)])
