"""Settings.  DaemonOptions fix how a device's daemon runs (shared by every
communicator on that device in this process); CommOptions how one
communicator moves data.  Defaults need no tuning."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from dfccl._deprecated import renamed_attributes
from dfccl._native.layout import LINK_AHEAD_MAX
from dfccl.errors import InvalidArgumentError

__all__ = ["DaemonOptions", "CommOptions", "LL_MAX_BYTES_LIMIT"]

#: Largest CommOptions.ll_max_bytes: beyond a few KiB per peer the direct
#: paths' bulk moves beat LL's 50 % line overhead anyway.
LL_MAX_BYTES_LIMIT = 64 << 10

# Old names, one release (design decision 43).
__getattr__ = renamed_attributes(__name__, {"ContextOptions": "DaemonOptions"})


def _check_ints(obj, names: tuple[str, ...]) -> None:
    """Integer fields are ints (or None where allowed), never bools or floats."""
    cls = type(obj).__name__
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidArgumentError(f"{cls}.{name} must be an int, not {type(value).__name__} ({value!r})")


LINK_AHEAD_ENV = "DFCCL_LINK_AHEAD"
DEFAULT_LINK_AHEAD = 0
LINK_BLOCK_ENV = "DFCCL_LINK_BLOCK"


def link_block(options: "DaemonOptions", resident_blocks: int | None, blocks: int) -> bool:
    """Whether a daemon runs a link block: the option, else the
    environment's, else on GPUs where the device has an SM to spare for it
    (``resident_blocks``: daemon blocks the device holds at once) and off in
    the simulator (``resident_blocks`` None), whose blocks are host threads
    that sleep between polls: a link thread there adds a sleep to every
    pickup instead of a round trip.  Every block of the daemon must be
    resident at once, so an explicit request that does not fit is an error,
    not a launch that could wait for ever."""
    fits = resident_blocks is None or blocks + 1 <= resident_blocks
    requested = options.link_block
    if requested is None:
        raw = os.environ.get(LINK_BLOCK_ENV, "").strip()
        if raw:
            if raw not in ("0", "1"):
                raise InvalidArgumentError(f"{LINK_BLOCK_ENV} must be 0 or 1, not {raw!r}")
            requested = raw == "1"
    if requested is None:
        return resident_blocks is not None and fits
    if requested and not fits:
        raise InvalidArgumentError(f"a link block needs {blocks + 1} resident daemon blocks and the device holds "
                                   f"{resident_blocks}; use fewer DaemonOptions.blocks or link_block=False")
    return requested


def link_ahead(options: "DaemonOptions") -> int:
    """The link_ahead a daemon runs with: the option, else the environment's, else the default."""
    if options.link_ahead is not None:
        return options.link_ahead
    raw = os.environ.get(LINK_AHEAD_ENV, "").strip()
    if not raw:
        return DEFAULT_LINK_AHEAD
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= LINK_AHEAD_MAX:
        raise InvalidArgumentError(f"{LINK_AHEAD_ENV} must be an integer in 0..{LINK_AHEAD_MAX}, not {raw!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class DaemonOptions:
    """How the daemon of one device runs.

    blocks: daemon blocks (= channels) per device; None: the backend's default
        (a quarter of the SMs on a GPU, at most 32; 2 in the simulator).
    max_outstanding: collectives that may be pending at once per device (a
        power of two).  Beyond it submission raises ResourceError instead of
        waiting (waiting could deadlock).
    preemption: False runs every collective to completion like NCCL (infinite
        windows).  Only for experiments showing what preemption prevents.
    base_window_ns / max_window_ns / idle_quit_ns / relaunch_backoff_ns: the
        scheduler's time bounds; None picks the backend's defaults.  The base
        window adapts at run time (policy.py) unless adaptive is False.
    empty_quit_ns: how long the daemon stays once nothing is left for it to
        run (idle_quit_ns applies while collectives wait: peers absent,
        streams not there yet).  None: 50 us on a GPU, 2 ms in the simulator.
        A resident daemon holds its SMs and makes device-wide
        synchronisations wait (docs/architecture.md, "Idle quit and
        relaunch"); longer saves the relaunch (7-15 us on an H200, most of
        it the launch call on the submitting thread) of a collective that
        follows a longer gap.
    link_ahead: submission-ring entries the daemon reads from host memory in
        the same round trip as the submission tail, before it knows they are
        there (0..3; docs/architecture.md, "The host link").  More saves a
        round trip per burst of submissions and costs host-memory reads on
        every poll (on one H200 in a VM, 0 was fastest: docs/performance-log.md).
        None: ``DFCCL_LINK_AHEAD`` from the environment, else 0.  A link
        block reads as far ahead as it can whatever this says.
    link_block: one more daemon block that does nothing but read the host
        link, round trip after round trip, so that a submission reaches the
        scheduler about one host round trip after it was written and no
        scheduler pass waits for PCIe (docs/architecture.md, "The host
        link").  It takes one SM.  None: ``DFCCL_LINK_BLOCK`` (0 or 1) from
        the environment, else on for GPUs with the SM to spare, off in the
        simulator.
    """

    blocks: int | None = None
    max_outstanding: int = 4096
    preemption: bool = True
    adaptive: bool = True
    base_window_ns: int | None = None
    max_window_ns: int | None = None
    idle_quit_ns: int | None = None
    empty_quit_ns: int | None = None
    relaunch_backoff_ns: int | None = None
    max_endpoints: int = 256
    link_ahead: int | None = None
    link_block: bool | None = None

    def __post_init__(self):
        _check_ints(self, ("blocks", "max_outstanding", "base_window_ns", "max_window_ns", "idle_quit_ns",
                           "empty_quit_ns", "relaunch_backoff_ns", "max_endpoints", "link_ahead"))
        if self.link_ahead is not None and not 0 <= self.link_ahead <= LINK_AHEAD_MAX:
            raise InvalidArgumentError(f"DaemonOptions.link_ahead must be in 0..{LINK_AHEAD_MAX}, not {self.link_ahead}")
        if self.link_block is not None and not isinstance(self.link_block, bool):
            raise InvalidArgumentError(f"DaemonOptions.link_block must be a bool or None, not {self.link_block!r}")
        for name in ("preemption", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"DaemonOptions.{name} must be a bool, not {getattr(self, name)!r}")
        n = self.max_outstanding
        if n < 8 or n & (n - 1):
            raise InvalidArgumentError(f"DaemonOptions.max_outstanding must be a power of two >= 8, not {n}")
        if self.blocks is not None and not 1 <= self.blocks <= 32:
            raise InvalidArgumentError(f"DaemonOptions.blocks must be in 1..32, not {self.blocks}")
        if self.max_endpoints < 1:
            raise InvalidArgumentError(f"DaemonOptions.max_endpoints must be >= 1, not {self.max_endpoints}")
        for name in ("base_window_ns", "max_window_ns", "idle_quit_ns", "empty_quit_ns", "relaunch_backoff_ns"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidArgumentError(f"DaemonOptions.{name} must be >= 0, not {getattr(self, name)}")


#: Tag records per rank when CommOptions.max_tags is None: twice the default
#: number of outstanding collectives, so that the default daemon never runs
#: out of records before it runs out of slots.
DEFAULT_MAX_TAGS = 2 * 4096
#: A communicator that spans hosts: one channel per this many bytes (two per
#: MiB, which the proxy's lanes carry side by side), and ring slices (one
#: network message each) up to this size, so that a collective of a MiB or
#: more moves messages of 128 KiB or more (docs/multi-node.md, "Message
#: size").
NET_BYTES_PER_CHANNEL = 512 << 10
#: ... but a collective of at least this many bytes takes two channels or
#: more, so that both lanes carry it: 256 KiB broadcasts took 140-149 us on
#: two channels against 168-196 on one (docs/performance-log.md, section 50).
NET_TWO_CHANNEL_BYTES = 256 << 10
NET_MAX_SLICE_BYTES = 512 << 10
#: ... and a channel of up to this many bytes goes as one slice: each slice
#: costs a message, a credit and a daemon step on both sides, which a
#: pipeline of small slices does not win back over the network.
NET_MIN_SLICE_BYTES = 64 << 10
#: ... and the shared staging goes to this many tags' FIFOs at once (the
#: GPU's default; the simulator's 128 would cut its slices to 48 KiB).
NET_RING_TAGS = 8
#: Smallest all-reduce (bytes per rank) that runs hierarchically where a
#: communicator spans hosts with several ranks on each (hierarchy.py), and
#: smallest reduce-scatter or all-gather (all ranks' blocks): two hosts of
#: two ranks on one H100 over TCP loopback, with a tag's calls in order,
#: the hierarchical all-reduce took 1.2-2.4x the ring's time at 1-8 MiB and
#: 0.76-0.93x at 16-64 MiB (docs/performance-log.md, section 54).
DEFAULT_HIERARCHY_MIN_BYTES = 16 << 20


@dataclass(frozen=True, kw_only=True)
class CommOptions:
    """How one communicator moves data.  Must be equal on every rank.

    path: "auto" (direct where every peer is reachable: ranks in this process
        read each other's buffers in place, ranks in other processes of the
        host through copies in each rank's arena up to staged_max_bytes;
        ring otherwise and above that size), "direct" (like auto, but an
        error where a peer is not reachable) or "ring".
    channels: most channels one collective uses; None: all daemon blocks,
        shared out among ranks of the communicator that share a daemon
        (one process, one device), which get disjoint blocks.
    max_tags: tag records per rank (tags bound at once); None: 8,192, twice
        the default DaemonOptions.max_outstanding.  A property of the
        communicator, equal on every rank whatever each device's daemon
        options.
    staging_bytes: staging per rank (ring FIFOs, staged copies): a quarter
        reserved as a minimum FIFO for every tag that can be pending, the
        rest shared (docs/architecture.md, "Staging budget").
    ring_slots: FIFO slots per channel (pipelining depth of the ring), >= 2.
    max_slice_bytes: largest FIFO slot (a multiple of 16).  None: 512 KiB
        on GPUs, 64 KiB on the simulator, 512 KiB on both where the
        communicator spans hosts.
    min_slice_bytes: a channel is cut into ring_slots slices only where
        they are at least this large (a multiple of 16, >= 256); a smaller
        channel goes in fewer, down to one slice of the whole channel.  The
        staging budget's cap (max_slice_bytes, ring_tags) still wins.
        None: 256 B; 64 KiB where the communicator spans hosts.
    one_shot_bytes: direct all-reduces up to this size (out of place) read
        every peer's whole input in one phase instead of two.
    bytes_per_channel: a collective uses one channel per this many bytes
        (at least one, at most `channels`).  None: 128 KiB on GPUs, 256 KiB
        on the simulator, 512 KiB where the communicator spans hosts (each
        ring slice is then a network message: fewer, larger ones).
    two_channel_bytes: a collective that moves at least this many bytes
        uses at least two channels (at most `channels`), whatever
        bytes_per_channel gives; 0: no such floor.  None: 0; 256 KiB where
        the communicator spans hosts (the network proxy carries two
        channels on two connections side by side).
    staged_max_bytes: largest collective (bytes one rank moves) that takes
        the direct path across processes; larger ones take the ring.  Each
        tag holds up to twice this much staging while it is bound.
    ring_tags: tags whose ring-path collectives get their planned FIFOs at
        once whatever their size: a tag's FIFO (channels x ring_slots x
        slice) is at most the shared staging // ring_tags, its slices
        shrinking to fit; more tags loop through reserved minimum FIFOs
        (docs/architecture.md, "Staging budget").  None: 8 on GPUs, 128 on
        the simulator, 8 on both where the communicator spans hosts.
    peer_timeout: seconds after which a peer in another process whose
        heartbeat has stopped is declared lost (PeerLostError on every pending
        and later collective); a peer whose process has exited is detected
        within a fraction of a second whatever this is.  None: only exits
        are detected (a stopped or hung peer is not).
    flight_events: events the flight recorder keeps per rank (0: off).
    protocol: "auto" (the eager low-latency protocol, LL, for all-reduce,
        all-gather and reduce-scatter whose per-rank piece is at most
        ll_max_bytes, on direct and staged communicators of 2..8 ranks; the
        paths above otherwise), "ll" (like auto, but an error where a
        communicator cannot use LL at all) or "simple" (never LL).
    ll_max_bytes: largest per-rank piece (bytes each rank sends every peer:
        the buffer of an all-reduce, the send buffer of an all-gather, the
        recv buffer of a reduce-scatter) that takes LL; 0 turns LL off.  It
        sizes the LL region of every rank's arena: max_tags x ranks x 2 x
        16 x (2 + ll_max_bytes / 8) bytes of receive areas, plus small acks
        (docs/architecture.md, "LL").  None: the largest
        multiple of 16 up to 4096 whose region fits ll_memory_bytes.
    ll_memory_bytes: budget of the LL region when ll_max_bytes is None.
    hierarchy_min_bytes: on a communicator whose ranks span two hosts or
        more with the same number (two or more) on each, all-reduces of at
        least this many bytes per rank whose count divides by the ranks per
        host run hierarchically: reduce-scatter within each host, all-reduce
        across hosts, all-gather within each host (docs/multi-node.md,
        "Hierarchical collectives"); so do reduce-scatters and all-gathers
        whose n blocks hold at least this many bytes where each host's ranks
        are contiguous.  Such a communicator builds two child
        communicators at start-up for it; 0 builds none and never runs
        one.  None: 16 MiB.
    """

    path: str = "auto"
    channels: int | None = None
    max_tags: int | None = None
    staging_bytes: int | None = None
    ring_slots: int = 4
    max_slice_bytes: int | None = None
    min_slice_bytes: int | None = None
    one_shot_bytes: int | None = None
    bytes_per_channel: int | None = None
    two_channel_bytes: int | None = None
    staged_max_bytes: int | None = None
    ring_tags: int | None = None
    peer_timeout: float | None = 10.0
    flight_events: int = 1024
    protocol: str = "auto"
    ll_max_bytes: int | None = None
    ll_memory_bytes: int | None = None
    hierarchy_min_bytes: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.path not in ("auto", "direct", "ring"):
            raise InvalidArgumentError(f"CommOptions.path must be 'auto', 'direct' or 'ring', not {self.path!r}")
        _check_ints(self, ("channels", "max_tags", "staging_bytes", "ring_slots", "max_slice_bytes",
                           "min_slice_bytes", "one_shot_bytes", "bytes_per_channel", "two_channel_bytes", "ring_tags",
                           "ll_max_bytes", "ll_memory_bytes", "hierarchy_min_bytes"))
        if self.protocol not in ("auto", "ll", "simple"):
            raise InvalidArgumentError(f"CommOptions.protocol must be 'auto', 'll' or 'simple', not {self.protocol!r}")
        if self.ll_max_bytes is not None and not 0 <= self.ll_max_bytes <= LL_MAX_BYTES_LIMIT:
            raise InvalidArgumentError(f"CommOptions.ll_max_bytes must be in 0..{LL_MAX_BYTES_LIMIT}, not "
                                       f"{self.ll_max_bytes}")
        if self.hierarchy_min_bytes is not None and self.hierarchy_min_bytes < 0:
            raise InvalidArgumentError(f"CommOptions.hierarchy_min_bytes must be >= 0, not {self.hierarchy_min_bytes}")
        if self.ll_memory_bytes is not None and self.ll_memory_bytes < 0:
            raise InvalidArgumentError(f"CommOptions.ll_memory_bytes must be >= 0, not {self.ll_memory_bytes}")
        # One slot deadlocks the ring: a step that receives and sends needs the
        # next rank to free its slot first, and the next rank waits likewise.
        if not 2 <= self.ring_slots <= 64:
            raise InvalidArgumentError(f"CommOptions.ring_slots must be in 2..64, not {self.ring_slots}")
        for name in ("max_slice_bytes", "min_slice_bytes"):
            value = getattr(self, name)
            if value is not None and (value < 256 or value % 16):
                raise InvalidArgumentError(f"CommOptions.{name} must be a multiple of 16 and >= 256, not {value}")
        if self.channels is not None and not 1 <= self.channels <= 32:
            raise InvalidArgumentError(f"CommOptions.channels must be in 1..32, not {self.channels}")
        if self.max_tags is not None and self.max_tags < 1:
            raise InvalidArgumentError(f"CommOptions.max_tags must be >= 1, not {self.max_tags}")
        for name in ("staging_bytes", "one_shot_bytes", "two_channel_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidArgumentError(f"CommOptions.{name} must be >= 0, not {getattr(self, name)}")
        if self.ring_tags is not None and self.ring_tags < 1:
            raise InvalidArgumentError(f"CommOptions.ring_tags must be >= 1, not {self.ring_tags}")
        if self.peer_timeout is not None:
            t = self.peer_timeout
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 1.0 or t == float("inf"):
                raise InvalidArgumentError(f"CommOptions.peer_timeout must be None or a finite number of seconds "
                                           f">= 1, not {t!r}")
        _check_ints(self, ("flight_events",))
        if self.flight_events < 0:
            raise InvalidArgumentError(f"CommOptions.flight_events must be >= 0, not {self.flight_events}")
        if self.bytes_per_channel is not None and self.bytes_per_channel < 1:
            raise InvalidArgumentError(f"CommOptions.bytes_per_channel must be >= 1, not {self.bytes_per_channel}")

    def resolved(self, backend: str) -> "CommOptions":
        """Fills backend defaults (GPU sizes differ from the simulator's)."""
        gpu = backend == "cuda"
        return replace(
            self,
            max_tags=self.max_tags if self.max_tags is not None else DEFAULT_MAX_TAGS,
            staging_bytes=self.staging_bytes if self.staging_bytes is not None else (256 << 20 if gpu else 64 << 20),
            ring_tags=self.ring_tags if self.ring_tags is not None else (8 if gpu else 128),
            max_slice_bytes=self.max_slice_bytes if self.max_slice_bytes is not None else (512 << 10 if gpu else 64 << 10),
            min_slice_bytes=self.min_slice_bytes if self.min_slice_bytes is not None else 256,
            one_shot_bytes=self.one_shot_bytes if self.one_shot_bytes is not None else (256 << 10 if gpu else 16 << 10),
            bytes_per_channel=self.bytes_per_channel if self.bytes_per_channel is not None else (128 << 10 if gpu else 256 << 10),
            two_channel_bytes=self.two_channel_bytes if self.two_channel_bytes is not None else 0,
            staged_max_bytes=self.staged_max_bytes if self.staged_max_bytes is not None else (1 << 20 if gpu else 256 << 10),
            ll_memory_bytes=self.ll_memory_bytes if self.ll_memory_bytes is not None else (128 << 20 if gpu else 8 << 20),
            hierarchy_min_bytes=(self.hierarchy_min_bytes if self.hierarchy_min_bytes is not None
                                 else DEFAULT_HIERARCHY_MIN_BYTES),
        )

    def resolved_for_network(self, resolved: "CommOptions") -> "CommOptions":
        """``resolved`` (this object's resolution) for a communicator that
        spans hosts: the sizes left to their defaults take the network's,
        which every rank knows alike (every rank of such a communicator has a
        peer on another host)."""
        return replace(
            resolved,
            bytes_per_channel=self.bytes_per_channel if self.bytes_per_channel is not None else NET_BYTES_PER_CHANNEL,
            two_channel_bytes=self.two_channel_bytes if self.two_channel_bytes is not None else NET_TWO_CHANNEL_BYTES,
            max_slice_bytes=self.max_slice_bytes if self.max_slice_bytes is not None else NET_MAX_SLICE_BYTES,
            min_slice_bytes=self.min_slice_bytes if self.min_slice_bytes is not None else NET_MIN_SLICE_BYTES,
            ring_tags=self.ring_tags if self.ring_tags is not None else NET_RING_TAGS,
        )
