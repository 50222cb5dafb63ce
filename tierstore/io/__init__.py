"""I/O engine of the NVMe tier: one device abstraction with posix / io_uring /
kvikio / memory backends, fragment gather-scatter into large aligned extents,
and the crash-safe log-structured :class:`SegmentStorage`."""

from .batch import DEFAULT_EXTENT_BYTES, ExtentPipeline
from .engine import IOEngine, IOFuture, IOObserver, ShortIOError, alloc_aligned
from .factory import ENGINE_KINDS, open_engine
from .pages import FragmentPlan, KVPagePool, gather_fragments, plan_fragments, scatter_fragments
from .segments import SegmentStorage

__all__ = [
    "DEFAULT_EXTENT_BYTES",
    "ENGINE_KINDS",
    "ExtentPipeline",
    "FragmentPlan",
    "IOEngine",
    "IOFuture",
    "IOObserver",
    "KVPagePool",
    "SegmentStorage",
    "ShortIOError",
    "alloc_aligned",
    "gather_fragments",
    "open_engine",
    "plan_fragments",
    "scatter_fragments",
]
