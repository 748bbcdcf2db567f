"""Transparent huge pages for large CPU buffers that are read at random.

Sampling reads all over a store of hundreds of MB, and with 4 KiB pages those
reads also miss the TLB (at 1e7 steps the window gather went from 94 to 80 µs
with huge pages; see docs/decisions.md). Linux backs memory with 2 MiB pages
where asked (``madvise``, the default THP mode on most distributions): this
asks, for buffers not yet touched, and is a no-op where it cannot (not Linux,
THP disabled).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_WORTH_IT = 4 * _HUGE_PAGE  # smaller buffers gain little


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _load_madvise()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages of a CPU tensor's memory; True if granted."""
    nbytes = tensor.numel() * tensor.element_size()
    if _madvise_fn is None or tensor.device.type != "cpu" or nbytes < _WORTH_IT:
        return False
    first = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return end > first and _madvise_fn(first, end - first, _MADV_HUGEPAGE) == 0


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on the CPU, backed by huge pages where the system allows."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor
