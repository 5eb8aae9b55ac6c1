"""`RedisBackend` against a real `redis-server` started on 127.0.0.1 for these tests (and stopped
after): hits across processes, a server stopped mid-run, damaged entries, the shared budget."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_prefix_store_directory import model, prompt  # the same model and prompts as the directory tests

from kvcache import CacheFormatError, KVCacheError
from kvcache.generation import generate
from kvcache.store import PrefixStore
from kvcache.store.redis_backend import RedisBackend

redis = pytest.importorskip("redis")
pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 8
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `redis-server` on 127.0.0.1, without persistence, in a temporary directory."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir, self.proc = _free_port(), workdir, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    srv = Server(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def store(url: str, **kwargs) -> PrefixStore:
    max_bytes = kwargs.pop("max_bytes", 1 << 30)
    return PrefixStore(chunk_size=CHUNK, max_bytes=max_bytes, backend=RedisBackend(url, **kwargs))


_WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    from kvcache.models import HybridConfig, HybridLM
    from kvcache.store import PrefixStore
    from kvcache.store.redis_backend import RedisBackend
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).eval()
    ids = torch.randint(1, 256, (1, 37), generator=torch.Generator().manual_seed(1))[0].tolist()
    PrefixStore(chunk_size={chunk}, backend=RedisBackend({url!r})).prefill(model, ids)
    """
)


def test_another_process_inserts_this_one_hits_exactly(server: Server) -> None:
    code = _WRITER.format(root=str(ROOT), chunk=CHUNK, url=server.url)
    procs = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    m, ids = model(), prompt()
    shared = store(server.url)
    assert len(shared) == 4  # two concurrent writers of one prefix: one entry per chunk
    hit = generate(m, ids, max_new_tokens=8, output_scores=True, prefix_store=shared)
    assert shared.stats.tokens_reused == 32
    local = PrefixStore(chunk_size=CHUNK)
    cold = generate(m, ids, max_new_tokens=8, output_scores=True, prefix_store=local)
    assert hit.sequences.tolist() == cold.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(hit.scores, cold.scores, strict=True))
    sizes = sum(info.nbytes for info in shared.backend.infos())
    assert shared.nbytes == sizes


def test_a_server_stopped_mid_run_is_a_miss_not_a_hang(server: Server) -> None:
    m, ids = model(), prompt()
    s = store(server.url, timeout=0.5)
    first = generate(m, ids, max_new_tokens=8, prefix_store=s)
    server.stop()
    start = time.monotonic()
    with pytest.warns(UserWarning, match="unavailable"):
        again = generate(m, ids, max_new_tokens=8, prefix_store=s)
    assert again.sequences.tolist() == first.sequences.tolist()  # computed without the store, same tokens
    assert time.monotonic() - start < 30
    with pytest.raises(KVCacheError, match="unavailable"):
        store(server.url, timeout=0.5, strict=True).lookup(ids[0].tolist(), m)
    from kvcache.cli import main

    assert main(["store", server.url]) == 2  # the report says the server is down, not "0 chunks"


def test_a_damaged_entry_is_dropped(server: Server) -> None:
    m, ids = model(), prompt()
    s = store(server.url)
    s.prefill(m, ids[0].tolist())
    keys = s._keys(ids[0].tolist(), s.fingerprint(m, m.new_cache()))
    client = redis.Redis.from_url(server.url)
    name = f"kvcache:e:{keys[1].hex()}"
    data = bytearray(client.get(name))
    data[-5] ^= 1
    client.set(name, bytes(data))
    with pytest.warns(UserWarning, match="dropped"):
        assert s.lookup(ids[0].tolist(), m)[0] == 8
    assert client.get(name) is None and len(s) == 3
    s.prefill(m, ids[0].tolist())  # put back
    client.set(name, b"garbage")
    with pytest.raises(CacheFormatError, match="dropped"):
        store(server.url, strict=True).lookup(ids[0].tolist(), m)


def test_the_shared_budget_holds(server: Server) -> None:
    m = model()
    probe = store(server.url, prefix="probe")
    probe.prefill(m, prompt(9, 17)[0].tolist())
    budget = int(probe.nbytes * 2.5)
    s = store(server.url, max_bytes=budget)
    for seed in range(6):
        s.prefill(m, prompt(seed, 25)[0].tolist())
        assert s.nbytes == sum(info.nbytes for info in s.backend.infos()) <= budget
    assert s.stats.evictions > 0
