"""A SUB that reads and discards, in a process of its own, so a PUB has a real peer.

Started with ``subprocess`` (``python -c``), not ``multiprocessing``'s spawn,
which would import the benchmark's own module, vLLM with it, in every reader
(seconds a run).  Its CPU is not the measured process's.
"""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys, zmq
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.setsockopt(zmq.RCVHWM, 0)
sub.connect(sys.argv[1])
poller = zmq.Poller()
poller.register(sub, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)  # readable at EOF: the benchmark is done
print("ready", flush=True)
while sys.stdin.fileno() not in dict(poller.poll()):
    while True:
        try:
            sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
"""


def start_reader(endpoint: str) -> subprocess.Popen[str]:
    """Start a reader connected to ``endpoint``; returns once it has connected."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CODE, endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def stop_reader(proc: subprocess.Popen[str]) -> None:
    """Stop a reader (closing its stdin) and wait for it."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
