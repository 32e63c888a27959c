"""Snapshot a training state into reusable shared-memory buffers, and rebuild it on the writer side.

The training thread calls :meth:`SnapshotBuffers.snapshot`: every dense tensor in the (nested
dict/list/tuple) state is copied into one preallocated shared-memory pool, and the rest of the
structure, with each tensor replaced by a slot number, is pickled (small: counters, param groups,
RNG tuples). The writer process receives the pool once, at its start, as a file descriptor, and
rebuilds the state with :func:`materialize` as zero-copy tensors over the pool: nothing large is
ever pickled or sent through a pipe.

The pool is a ``memfd`` mapped ``MAP_SHARED``: anonymous (freed when the last process holding it
exits, so a SIGKILL leaks nothing), not limited by a small ``/dev/shm`` as in containers, and
pre-faulted once (``MAP_POPULATE``) so each snapshot is a plain memcpy. When the state holds CUDA
tensors the pool is page-locked with ``cudaHostRegister`` so device-to-host copies run asynchronously.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import torch

_ALIGN = 64
_COPY_CHUNK = 8 << 20


class _Slot:
    """Stands in for the tensor number ``index`` inside a pickled state skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Slot, (self.index,))


def _poolable(t: torch.Tensor) -> bool:
    """Plain dense CPU/CUDA tensors go to the pool; anything exotic is pickled with the skeleton."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type in ("cpu", "cuda")
    )


def _map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild ``obj``'s containers (dict, OrderedDict, list, tuple, named tuple) with ``leaf`` applied to the rest."""
    if type(obj) is dict:
        return {k: _map_leaves(v, leaf) for k, v in obj.items()}
    if type(obj) is OrderedDict:
        return OrderedDict((k, _map_leaves(v, leaf)) for k, v in obj.items())
    if type(obj) is list:
        return [_map_leaves(v, leaf) for v in obj]
    if type(obj) is tuple:
        return tuple(_map_leaves(v, leaf) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_leaves(v, leaf) for v in obj))
    return leaf(obj)


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``state`` into a skeleton (tensors replaced by slots) and the list of those tensors.

    Walks dicts (``dict``, ``OrderedDict``), lists, tuples and named tuples; any other object is
    kept as it is and will be pickled. The same tensor object appearing twice gets one slot.
    """
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def leaf(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if not _poolable(obj):  # pickled by value; never let a writer process touch a GPU
                return obj.detach().cpu() if obj.device.type != "cpu" else obj
            idx = seen.get(id(obj))
            if idx is None:
                idx = seen[id(obj)] = len(tensors)
                tensors.append(obj)
            return _Slot(idx)
        return obj

    return _map_leaves(state, leaf), tensors


def _unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return _map_leaves(skeleton, lambda obj: tensors[obj.index] if type(obj) is _Slot else obj)


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a checkpoint snapshot")
    return dtype


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one tensor lives in the pool."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _dtype_from_name(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


def plan_layout(tensors: list[torch.Tensor]) -> tuple[list[TensorLayout], int]:
    """Offsets (64-byte aligned) of each tensor in a pool, and the pool size they need."""
    layout, offset = [], 0
    for t in tensors:
        layout.append(TensorLayout(offset, str(t.dtype), tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, offset


class SharedPool:
    """One block of shared memory (memfd + mmap) that snapshots are copied into.

    Picklable for a child process: the file descriptor travels with it (through the fork server,
    or ``multiprocessing``'s resource sharer) and the child maps the same pages.
    """

    def __init__(self, nbytes: int, *, _fd: int | None = None) -> None:
        self.nbytes = max(int(nbytes), _ALIGN)
        if _fd is None:
            _fd = os.memfd_create("elastictrain-checkpoint", os.MFD_CLOEXEC)
            os.ftruncate(_fd, self.nbytes)
        self._fd = _fd
        self._mm = mmap.mmap(_fd, self.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._view = memoryview(self._mm)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach_pool, (reduction.DupFd(self._fd), self.nbytes))

    def pin(self) -> bool:
        """Page-lock the pool for asynchronous device-to-host copies; False when CUDA refuses."""
        if not self.pinned and torch.cuda.is_available():
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0))
            self.pinned = err == 0
        return self.pinned

    def dest(self, spec: TensorLayout) -> torch.Tensor:
        """A writable tensor view of ``spec``'s place in the pool (for the training-thread copy)."""
        dtype = _dtype_from_name(spec.dtype)
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=dtype)
        return self.tensor[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)

    def own_tensor(self, spec: TensorLayout) -> torch.Tensor:
        """A zero-copy tensor over ``spec``'s bytes with its own storage, so torch.save writes only those."""
        dtype = _dtype_from_name(spec.dtype)
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=dtype)
        raw = torch.frombuffer(self._view[spec.offset : spec.offset + spec.nbytes], dtype=torch.uint8)
        return raw.view(dtype).view(spec.shape)

    def close(self) -> None:
        """Drop this process's mapping (tensors still referencing it keep it alive until they go)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor
        with contextlib.suppress(BufferError):  # views still alive: unmapped when the last one is freed
            self._view.release()
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _attach_pool(dupfd: Any, nbytes: int) -> SharedPool:
    return SharedPool(nbytes, _fd=dupfd.detach())


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the writer needs besides the pool: the pickled skeleton and where each tensor sits."""

    skeleton: bytes
    layout: tuple[TensorLayout, ...]


def materialize(snapshot: Snapshot, pool: SharedPool) -> Any:
    """Rebuild the state from ``snapshot``: tensors are zero-copy views of ``pool`` (writer side)."""
    tensors = [pool.own_tensor(spec) for spec in snapshot.layout]
    return _unflatten(pickle.loads(snapshot.skeleton), tensors)


class _ParallelCopier:
    """memcpy of CPU tensors into the pool, split over a few threads.

    One thread does not saturate memory bandwidth: measured on a 2-core VM, 256 MiB took 15 ms with
    ``Tensor.copy_`` or one ``memmove`` and 8 ms with two threads. ``ctypes.memmove`` releases the
    GIL and is independent of ``torch.set_num_threads`` (a trainer often runs at 1 thread).
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="elastictrain-snapshot")
            if self.threads > 1
            else None
        )

    def copy(self, moves: list[tuple[int, int, int]]) -> None:
        """Perform ``(dst_ptr, src_ptr, nbytes)`` copies; returns when all are done."""
        chunks = [
            (dst + off, src + off, min(_COPY_CHUNK, n - off))
            for dst, src, n in moves
            for off in range(0, n, _COPY_CHUNK)
        ]
        total = sum(c[2] for c in chunks)
        if self._pool is None or total < 2 * _COPY_CHUNK:
            _memmove_all(chunks)
            return
        share, acc = total / self.threads, 0
        parts: list[list[tuple[int, int, int]]] = []
        part: list[tuple[int, int, int]] = []
        for c in chunks:  # contiguous runs of about equal bytes: neighbours stay on one thread
            part.append(c)
            acc += c[2]
            if acc >= share * (len(parts) + 1) and len(parts) < self.threads - 1:
                parts.append(part)
                part = []
        parts.append(part)
        futures = [self._pool.submit(_memmove_all, p) for p in parts[1:]]
        _memmove_all(parts[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _memmove_all(chunks: list[tuple[int, int, int]]) -> None:
    for dst, src, n in chunks:
        ctypes.memmove(dst, src, n)


class SnapshotBuffers:
    """The reusable snapshot buffers of one checkpointer. Used from the training thread only.

    The pool is allocated on the first snapshot and reused while the state's tensors keep their
    shapes and dtypes; when they change, the layout is re-planned and the pool reallocated if it no
    longer fits (or is more than twice too big). :attr:`generation` counts pools, so the owner knows
    when a writer process must be handed the new one.
    """

    def __init__(self, *, pin_memory: bool | None = None, copy_threads: int | None = None) -> None:
        self._pin_memory = pin_memory
        self._copier = _ParallelCopier(copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1))
        self.pool: SharedPool | None = None
        self.generation = 0
        self._key: tuple[tuple[str, tuple[int, ...]], ...] | None = None
        self._layout: tuple[TensorLayout, ...] = ()
        self._dests: list[torch.Tensor] = []

    def snapshot(self, state: Any) -> tuple[Snapshot, list[torch.cuda.Event]]:
        """Copy ``state`` into the pool. Returns the snapshot and CUDA events to wait on (if any).

        Call only when no writer is reading the pool. CUDA tensors are copied asynchronously; the
        copy is complete once every returned event has completed (later kernels on the same stream
        are ordered after it, so training may go on at once).
        """
        skeleton, tensors = flatten_state(state)
        key = tuple((str(t.dtype), tuple(t.shape)) for t in tensors)
        if key != self._key:
            self._relayout(tensors, key)
        assert self.pool is not None
        has_cuda = any(t.is_cuda for t in tensors)
        pinned = has_cuda and self._pin_memory is not False and self.pool.pin()
        moves = []
        for dst, src in zip(self._dests, tensors, strict=True):
            if src.is_cuda or not src.is_contiguous() or src.is_conj() or src.is_neg() or src.numel() == 0:
                dst.copy_(src.detach(), non_blocking=pinned and src.is_cuda)
            else:
                moves.append((dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()))
        self._copier.copy(moves)
        events = []
        if has_cuda:
            for dev in {t.device for t in tensors if t.is_cuda}:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                events.append(ev)
        return Snapshot(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), self._layout), events

    def _relayout(self, tensors: list[torch.Tensor], key: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        layout, need = plan_layout(tensors)
        if self.pool is None or need > self.pool.nbytes or need * 2 < self.pool.nbytes:
            old, self.pool, self._dests = self.pool, None, []
            if old is not None:
                old.close()
            self.pool = SharedPool(need)
            self.generation += 1
        self._layout = tuple(layout)
        self._dests = [self.pool.dest(spec) for spec in self._layout]
        self._key = key

    def close(self) -> None:
        self._dests = []
        self._copier.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self._key = None
