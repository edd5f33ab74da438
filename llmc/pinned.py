"""
llmc/pinned.py: the host side of gpt2_cuda.py's per-micro-batch uploads: page-locked (pinned) host
memory, so that a copy to the GPU is queued asynchronously rather than staged synchronously by the
driver (CUDA C Programming Guide, "Page-Locked Host Memory").
"""

import numpy as np

from llmc import cuda
from llmc.cuda import ceil_div


class PinnedStaging:
    """The host side of the per-micro-batch uploads (token ids, targets, the dwte chunks): two
    page-locked (pinned) host buffers used in turn. The host writes an array into one, and the
    copy to the device is queued asynchronously on the current stream (from pageable memory the
    driver would first stage it synchronously). Before a buffer is written again, the host waits
    for the event recorded after its previous copies: by then the GPU has long read it (the other
    buffer served the upload in between)."""

    ALIGNMENT = 64                         # bytes: each staged array starts aligned for any dtype

    def __init__(self):
        self.buffers = []                  # two uint8 NumPy views of pinned memory
        self.events = [None, None]         # the event after each buffer's last copies
        self.turn = 0

    def reserve(self, nbytes):
        """Make both buffers hold at least nbytes (allocated once per size; the old ones are
        freed only after their copies are done)."""
        if self.buffers and self.buffers[0].size >= nbytes:
            return
        for event in self.events:
            if event is not None:
                event.synchronize()
        cp = cuda.cupy()
        self.buffers = [np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes) for _ in range(2)]
        self.events = [None, None]

    def upload(self, copies):
        """copies: (device array, host array) pairs of equal shape and dtype. Each host array is
        copied into the next pinned buffer, and from there to its device array asynchronously."""
        def aligned(n):
            return ceil_div(n, self.ALIGNMENT) * self.ALIGNMENT
        self.reserve(sum(aligned(src.nbytes) for _, src in copies))
        i, self.turn = self.turn, 1 - self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()   # the GPU has read this buffer's previous contents
        stream = cuda.cupy().cuda.get_current_stream()
        offset = 0
        for dst, src in copies:
            staged = self.buffers[i][offset:offset + src.nbytes].view(src.dtype).reshape(src.shape)
            staged[...] = src
            dst.set(staged, stream=stream)                # asynchronous: from pinned memory
            offset += aligned(src.nbytes)
        self.events[i] = stream.record()
