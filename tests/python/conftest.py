"""Shared pieces of the Python suite: host pools shaped as SGLang's, a redis-server."""
import os
import shutil
import socket
import subprocess
import time

import pytest

try:
    import torch
except ImportError:  # the test modules skip with the reason
    torch = None


class HostPool:
    """A host KV pool with the attributes, shapes and flat-page methods of SGLang's
    MHATokenToKVPoolHost / MLATokenToKVPoolHost (what a storage backend is handed)."""

    def __init__(self, layout, mla=False, layers=3, heads=2, head_dim=8, page_size=4, pages=16,
                 dtype=None):
        dtype = dtype or torch.bfloat16
        self.layout, self.page_size, self.layer_num = layout, page_size, layers
        self.head_num, self.head_dim, self.dtype = (1 if mla else heads), head_dim, dtype
        self.size = pages * page_size
        S, L, P, H, D = self.size, layers, page_size, self.head_num, head_dim
        if mla:
            shape = {"layer_first": (L, S, 1, D), "page_first": (S, L, 1, D),
                     "page_first_direct": (S // P, L, P, 1, D)}[layout]
        else:
            shape = {"layer_first": (2, L, S, H, D), "page_first": (2, S, L, H, D),
                     "page_first_direct": (2, S // P, L, P, H, D)}[layout]
        self.mla = mla
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def fill_random(self, seed):
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(-30000, 30000, self.kv_buffer.shape, generator=g, dtype=torch.int16)
        self.kv_buffer.view(torch.int16).copy_(raw)

    def _page(self, index):
        P = self.page_size
        b = self.kv_buffer
        if self.mla:
            return {"layer_first": lambda: b[:, index:index + P],
                    "page_first": lambda: b[index:index + P],
                    "page_first_direct": lambda: b[index // P]}[self.layout]()
        return {"layer_first": lambda: b[:, :, index:index + P],
                "page_first": lambda: b[:, index:index + P],
                "page_first_direct": lambda: b[:, index // P]}[self.layout]()

    def get_data_page(self, index, flat=True):
        page = self._page(index).contiguous()
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        self._page(index).copy_(data_page.reshape(self._page(index).shape))

    def page_bytes(self, index):
        """The page's bytes as the engine sees them (its own tensor), for comparisons."""
        return bytes(self.get_data_page(index).view(torch.int16).numpy().tobytes())


@pytest.fixture
def host_pool():
    return HostPool


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, path):
        self.path = path
        self.port = _free_port()
        self._start()

    def restart(self):
        """A fresh, empty server on the same port (after kill())."""
        self.kill()
        self._start()

    def _start(self):
        path = self.path
        self.proc = subprocess.Popen(
            [path, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis_server():
    path = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(path):
        pytest.skip("redis-server is not installed")
    server = RedisServer(path)
    yield server
    server.kill()
