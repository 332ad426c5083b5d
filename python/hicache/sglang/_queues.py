"""The controller's completions as SGLang reads them: the ack queues (list-like, and answering
queue.Queue's qsize / get), the ack tuples and their events, the feeds that drain hicache's C++
threads' reports, and LayerDoneCounter (the per-layer wait of a load batch)."""

import collections
import queue
import threading
import time

# A blocking wait without a timeout waits in slices of this many seconds (each ends early when
# what it waits for arrives), so that close() on another thread is never held up for ever.
_WAIT_SLICE_S = 60.0


class HiCacheDeviceError(RuntimeError):
    """A copy between device and host memory failed: the bytes are not to be used."""


class _DoneEvent:
    """An event that has completed: a load ack's events (a load is acknowledged once its copy
    completed) and every ack's start_event."""

    def query(self):
        return True

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


_DONE = _DoneEvent()
HiCacheAck = collections.namedtuple("HiCacheAck", "start_event finish_event node_ids")
BackupAck = collections.namedtuple("BackupAck", "id completed_tokens")


class _Feed:
    """One kind of completion hicache's C++ threads report (write or load acks, backup acks,
    revokes). `drain(n, timeout_s)` moves what arrived out of C++, waiting without the GIL on
    the controller's event signal until n arrived or the timeout passed; `deliver(items)`
    records them. One thread drains at a time: another that waits meanwhile sleeps on a
    condition the drainer notifies, so no thread waits for an arrival another one took."""

    def __init__(self, drain, deliver):
        self._drain = drain
        self._deliver = deliver
        self._cv = threading.Condition()
        self._draining = False

    def poll(self):
        """Records what arrived so far; never blocks (while another thread drains, that one
        records it)."""
        with self._cv:
            if not self._draining:
                self._deliver(self._drain(0, 0.0))

    def wait(self, ready, timeout=None):
        """Records arrivals until ready() or `timeout` seconds (None: no limit); ready()."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cv:
            while not ready():
                left = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._draining:
                    self._cv.wait(left)
                    continue
                self._draining = True
                self._cv.release()
                try:
                    items = self._drain(1, min(left, _WAIT_SLICE_S))
                finally:
                    self._cv.acquire()
                    self._draining = False
                    self._cv.notify_all()
                self._deliver(items)
            return True


class _CopyEvent:
    """The finish_event of a write ack (the ack is in ack_write_queue as soon as write()
    returns, as in SGLang 2025-09): query() says whether hicache's write thread finished the
    copy, synchronize() / wait() wait for it without the GIL. A copy that failed raises
    HiCacheDeviceError (its host pages were freed), as does one that reset() dropped."""

    __slots__ = ("_controller", "node", "_state")

    def __init__(self, controller, node):
        self._controller = controller
        self.node = node
        self._state = None  # None: in flight; True: done; a message: failed or dropped

    def _settled(self):
        return self._state is not None

    def _result(self):
        if self._state is None:
            return False
        if self._state is True:
            return True
        self._controller._failures.pop(self, None)  # raised here: not again by the queue
        raise HiCacheDeviceError(f"hicache: {self._state}: those bytes are not to be used")

    def query(self):
        if self._state is None:
            self._controller._write_feed.poll()
        return self._result()

    def synchronize(self):
        if self._state is None:
            self._controller._write_feed.wait(self._settled)
        self._result()

    def wait(self, stream=None):
        """The copy is waited for on the host: once it returns the bytes are in host memory,
        which orders them before any later work on any stream."""
        self.synchronize()


class _AckQueue:
    """A list of acks (SGLang's later releases iterate, pop and slice it) that also answers as
    a queue.Queue (qsize, empty, get, get_nowait: the 2025 releases). The list holds every ack
    posted; the queue view sees only those whose copy is done (`done(item)`), and get() returns
    `unwrap(item)`. Every read first records what the C++ side reported since (`feed`), then
    raises a failure `check` finds (after the good acks are in the list). get(block=True,
    timeout=t) waits up to t without the GIL, then raises queue.Empty, as queue.Queue does."""

    def __init__(self, feed, unwrap=lambda item: item, done=lambda item: True,
                 check=lambda: None):
        self._feed = feed
        self._unwrap = unwrap
        self._done = done
        self._check = check
        self._items = []

    def _refresh(self):
        self._feed.poll()
        self._check()
        return self._items

    # list
    def __len__(self):
        return len(self._refresh())

    def __iter__(self):
        return iter(list(self._refresh()))

    def __getitem__(self, i):
        return self._refresh()[i]

    def __delitem__(self, i):
        del self._items[i]

    def __bool__(self):
        return len(self) > 0

    def pop(self, i=-1):
        return (self._items or self._refresh()).pop(i)  # what was counted is there already

    def append(self, item):
        self._items.append(item)

    def clear(self):
        self._items.clear()

    # queue.Queue
    def _first_done(self):
        return next((i for i, item in enumerate(self._items) if self._done(item)), None)

    def qsize(self):
        self._refresh()
        return sum(1 for item in self._items if self._done(item))

    def empty(self):
        return self.qsize() == 0

    def get(self, block=True, timeout=None):
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        self._refresh()
        if self._first_done() is None and block:
            self._feed.wait(lambda: self._first_done() is not None, timeout)
            self._check()
        i = self._first_done()
        if i is None:
            raise queue.Empty
        return self._unwrap(self._items.pop(i))

    def get_nowait(self):
        return self.get(block=False)


class _ReleaseQueue:
    """host_mem_release_queue: the drop-in frees released host pages at once, so nothing is
    ever queued here. qsize() is 0; get() raises queue.Empty after waiting as queue.Queue would
    (without the GIL): `timeout` seconds, or, blocking without a timeout, until the controller
    closes (close() ends the wait, since nothing else ever can)."""

    def __init__(self):
        self._closed = threading.Event()

    def close(self):
        self._closed.set()

    def qsize(self):
        return 0

    def empty(self):
        return True

    def __len__(self):
        return 0

    def __iter__(self):
        return iter(())

    def get(self, block=True, timeout=None):
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if block:
            self._closed.wait(timeout)
        if block and timeout is None:
            raise queue.Empty("hicache: the controller closed; host_mem_release_queue never "
                              "holds anything (the drop-in frees released host pages at once)")
        raise queue.Empty

    def get_nowait(self):
        return self.get(block=False)

    def clear(self):
        pass


class LayerDoneCounter:
    """SGLang's LayerDoneCounter over hicache's: the device pool's get_key_buffer(layer) calls
    wait_until(layer), which returns once that layer of the consumer's load batch is in device
    memory (without the GIL), and raises HiCacheDeviceError when the batch failed, was dropped
    by reset() or never started. A batch holds a slot of hicache's counter until its consumer
    waited for the last layer or set another consumer, or until every slot is taken and a new
    batch starts (SGLang's ring of producer slots never blocks the scheduler); hicache hands a
    slot to a new batch only once the old one's copies are all done, and a consumer of a batch
    whose slot moved on finds its layers in place. Slots carry a generation, so a consumer never
    releases or waits for a later batch in the same slot."""

    def __init__(self, controller, num_layers, num_slots):
        self._c = controller
        self.num_layers = num_layers
        self.num_counters = num_slots
        self._lock = threading.Lock()
        self._next_gen = 1
        self._live = {}  # slot -> the generation of the batch started in it (until reset)
        self._held = collections.deque()  # (slot, gen) not released by their consumer, oldest first
        self._void = set()  # (slot, gen) dropped by reset()
        self._consumer = None  # (slot, gen)
        self.producer_index = -1

    @property
    def consumer_index(self):
        return -1 if self._consumer is None else self._consumer[0]

    def _release(self, entry):
        with self._lock:
            if entry not in self._held:
                return
            self._held.remove(entry)
        self._c._cache.release_loading(entry[0])

    def _make_room(self):
        with self._lock:
            oldest = self._held[0] if len(self._held) >= self.num_counters else None
        if oldest is not None:
            self._release(oldest)

    def _started(self, slot):
        with self._lock:
            gen, self._next_gen = self._next_gen, self._next_gen + 1
            self._live[slot] = gen
            self._held.append((slot, gen))
        self.producer_index = slot

    def _forget(self):
        with self._lock:
            self._void.update(self._live.items())  # the controller's reset voided every batch
            self._live.clear()
            self._held.clear()
        self._consumer = None
        self.producer_index = -1

    def next_producer(self):
        """SGLang 2025's ready_to_load_host_cache() calls this, then sets load_cache_event: the
        loads queued since the last batch start now, and their slot is returned (-1: none)."""
        return self._c.start_loading()

    def update_producer(self):
        return self.producer_index

    def set_consumer(self, index):
        previous = self._consumer
        with self._lock:
            self._consumer = None if index < 0 else (index, self._live.get(index, 0))
        if previous is not None and previous != self._consumer:
            self._release(previous)

    def wait_until(self, threshold):
        consumer = self._consumer
        if consumer is None:
            return
        slot, gen = consumer
        with self._lock:
            void = gen == 0 or consumer in self._void
            moved_on = self._live.get(slot) != gen  # a later batch has the slot: ours is done
        if void:
            raise HiCacheDeviceError(
                f"hicache: load batch {slot} was dropped by reset() or never started; its bytes "
                "are not in device memory")
        # On a GPU the wait is the engine's current stream's, on the device: the host returns
        # once the layer's copy is enqueued, and the kernels queued after this call read it.
        if not moved_on and not self._c._cache.wait_layer(slot, int(threshold),
                                                          self._c._compute_stream()):
            raise HiCacheDeviceError(
                f"hicache: layer {threshold} of load batch {slot} failed or the controller "
                "stopped: its bytes are not in device memory")
        if threshold >= self.num_layers - 1:
            self._release(consumer)

    def reset(self):
        pass  # the producer side is hicache's own
