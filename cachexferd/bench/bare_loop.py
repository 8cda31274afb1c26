"""The ceiling for ``cachexferd bench commands``: the least a Python command server can do.

A ROUTER receives each command, msgpack-decodes it, encodes an outcome map and PUSHes it
to the client's event endpoint. No asyncio, no validation, no ordering, no copy: pyzmq and
msgpack only. Run as ``python -m cachexferd.bench.bare_loop COMMAND_ENDPOINT EVENTS_ENDPOINT``;
it prints "ready" once bound and exits when its stdin closes or on SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import msgpack
import zmq

_HEADER_EVENT = b"CX\x01\x81"  # magic, major 1, EVENT


def serve(command_endpoint: str, events_endpoint: str, stop: threading.Event) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 100_000)
    router.bind(command_endpoint)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 100_000)
    push.connect(events_endpoint)
    print("ready", flush=True)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while not stop.is_set():
        if not poller.poll(100):
            continue
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            body = msgpack.unpackb(frames[2], raw=False)
            outcome = {"req_id": body["req_id"], "boot_id": "bare", "rank": 0, "op": frames[1][3], "code": 0,
                       "error": "OK", "detail": "", "result": {}}  # fmt: skip
            push.send_multipart([_HEADER_EVENT, msgpack.packb(outcome)])
    router.close(0)
    push.close(0)
    ctx.term()


def start_bare_loop(endpoint: str, events: str) -> subprocess.Popen[bytes]:
    """A ``bare_loop`` process serving ``endpoint``; returns once it is bound."""
    argv = [sys.executable, "-m", "cachexferd.bench.bare_loop", endpoint, events]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        proc.wait(10)
        raise RuntimeError("the bare loop did not start")
    return proc


def main() -> None:
    stop = threading.Event()

    def watch_stdin() -> None:  # stdin closing (the parent exited or closed it) stops the loop
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    serve(sys.argv[1], sys.argv[2], stop)


if __name__ == "__main__":
    main()
