"""`kvcache serve` runs its engine in a process of its own (the default, `--engine process`): the
model is there, answers are what the model gives alone, the server's shutdown ends it, and neither
process outlives the other: an engine that dies leaves 503s (the server still answers `/health`
and `/metrics`), a server that dies takes its engine with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_kit import ServeProcess  # noqa: E402

from kvcache.generation import generate  # noqa: E402
from kvcache.models import load_default_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "kvcache-default"
PROMPT = "The value of the key is "


def expected(n: int) -> str:
    model, tokenizer = load_default_model(dtype=torch.float64)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    return tokenizer.decode(generate(model, ids, max_new_tokens=n).sequences[0, ids.shape[1] :].tolist())


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":  # exited, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def complete(server: ServeProcess, n: int = 8) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": n, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_the_engine_runs_in_a_child_and_ends_with_the_server(tmp_path) -> None:
    server = ServeProcess("--dtype", "float64", "--threads", "1")
    server.start(tmp_path / "stderr.log")
    try:
        engine = server.engine_pid()
        answer = complete(server)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected(8)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text  # kept by the server from the engine's events
        assert "kvcache_generated_tokens_total 8.0" in metrics and "kvcache_prefix_lookups_total 1.0" in metrics
    finally:
        assert server.terminate() == 0, server.log()
    assert gone(engine, 10), "the engine process outlived the server"


def test_an_engine_that_dies_leaves_503s_and_a_server_that_answers(tmp_path) -> None:
    server = ServeProcess("--dtype", "float64", "--threads", "1")
    server.start(tmp_path / "stderr.log")
    try:
        engine = server.engine_pid()
        os.kill(engine, signal.SIGKILL)
        assert gone(engine, 10)
        deadline = time.monotonic() + 10
        while (answer := complete(server)).status_code != 503:  # the server learns of it from the pipe
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.05)
        error = answer.json()["error"]
        assert "engine process ended unexpectedly" in error["message"]
        with pytest.raises(openai.APIStatusError) as raised:  # what the official client sees
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4)  # fmt: skip
        assert raised.value.status_code == 503
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["running"] == 0
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    finally:
        code = server.terminate()
    assert code == 0, server.log()
    assert "engine process ended unexpectedly" in server.log() and "Traceback" not in server.log()


def test_a_server_that_dies_takes_its_engine_with_it(tmp_path) -> None:
    server = ServeProcess("--dtype", "float64", "--threads", "1")
    server.start(tmp_path / "stderr.log")
    engine = server.engine_pid()
    server.proc.kill()  # SIGKILL: no shutdown runs; the engine sees its pipe close
    server.proc.wait(10)
    assert gone(engine, 15), "the engine process was orphaned"


def test_an_engine_that_cannot_start_is_a_one_line_error(tmp_path, capsys) -> None:
    """The engine process builds the model's engine; what it refuses reaches the command line as
    the same one-line error the server process would print."""
    from kvcache.cli import main

    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    code = main(["serve", "--dtype", "float64", "--prefix-store", str(not_a_directory), "--port", "0"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "is a file, not a directory" in err and "Traceback" not in err


def test_the_engine_thread_remains_an_option(tmp_path) -> None:
    """`--engine thread` runs the engine in the server's own process, with the same answers."""
    server = ServeProcess("--dtype", "float64", "--threads", "1", "--engine", "thread")
    server.start(tmp_path / "stderr.log")
    try:
        assert not [pid for pid in server.children() if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        answer = complete(server)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected(8)
    finally:
        assert server.terminate() == 0, server.log()


def test_two_stops_at_once_close_the_pipe_once(tmp_path) -> None:
    """At the shutdown's deadline the server stops the engine from a worker thread while the app's
    lifespan stops it on the event loop. Both wait for the child, but only one may close the pipe:
    a second close of its descriptor's number fails (EBADF, a traceback in the server's log), or
    closes whatever the server opened under that number in between. The pipe's close is slowed
    here so that both stops reach it together."""
    import asyncio
    import threading

    from kvcache.cli import build_parser
    from kvcache.cli.serve import build_engine
    from kvcache.serve.engine_process import EngineProcess

    args = build_parser().parse_args(["serve", "--dtype", "float64", "--threads", "1", "--prefix-store",
                                      str(tmp_path / "store")])  # fmt: skip
    args.max_step_tokens, args.speculation_chosen = 256, False
    engine = EngineProcess(args, build_engine)
    engine.launch()
    closed_by: list[str] = []
    really_close = engine._conn._close

    def slow_close() -> None:
        closed_by.append(threading.current_thread().name)
        time.sleep(0.3)
        really_close()

    engine._conn._close = slow_close

    async def shut_down() -> None:
        engine.start()
        worker = asyncio.ensure_future(asyncio.to_thread(engine.stop, 5.0))
        await asyncio.sleep(0.2)  # the worker waits for the loop to read the child's last messages
        engine.stop(5.0)
        await worker  # (raised OSError: Bad file descriptor before)

    asyncio.run(shut_down())
    assert len(closed_by) == 1 and engine._conn.closed and not engine._process.is_alive()
