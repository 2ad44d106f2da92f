"""Replay memory: what N replay clients that never read cost the publisher's process.

Each client (in a separate process, so its own buffers are not counted) asks
for the whole replay buffer and never reads (RCVHWM 1).  The publisher's RSS
growth is measured once the replies have stopped moving, for coalesce's
defaults and for vLLM's ROUTER high-water mark (2 * (buffer_steps + 1)
messages per client, emulated with ``replay_window`` and no connection cap).

    .venv/bin/python benchmarks/bench_replay.py [--clients 5 20 40]
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import subprocess
import sys
import time

from coalesce import BlockStored, CoalescingPublisher, KVEventBatch
from coalesce_tools.results import recording

CLIENTS = """
import sys, zmq
ctx = zmq.Context.instance(); socks = []
for _ in range(int(sys.argv[2])):
    d = ctx.socket(zmq.DEALER); d.setsockopt(zmq.RCVHWM, 1); d.setsockopt(zmq.RCVBUF, 4096)
    d.setsockopt(zmq.LINGER, 0); d.connect(sys.argv[1])
    d.send_multipart([b"", (0).to_bytes(8, "big")]); socks.append(d)
print("sent", flush=True); sys.stdin.read()
"""


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    clients: int, buffer: int, window: int | None, max_clients: int | None
) -> tuple[float, int]:
    p = port()
    kw = {} if window is None else {"replay_window": window}
    if max_clients is not None:
        kw["replay_max_clients"] = max_clients
    pub = CoalescingPublisher(
        endpoint=f"inproc://bench-{p}",
        replay_endpoint=f"tcp://127.0.0.1:{p}",
        buffer_steps=buffer,
        compaction=False,
        **kw,
    )
    tokens = list(range(2500))  # ~10 kB per encoded message
    for i in range(buffer):
        pub.publish(
            KVEventBatch(float(i), [BlockStored([i], None, tokens, 2500, None, "GPU", None)])
        )
        if i % 200 == 0:
            pub.flush(30)
    pub.flush(30)
    gc.collect()
    before = rss_mb()
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, f"tcp://127.0.0.1:{p}", str(clients)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
    last, still = -1, 0
    deadline = time.monotonic() + 120
    while still < 5 and time.monotonic() < deadline:  # until replies stop moving for 1 s
        time.sleep(0.2)
        n = pub.stats().replay_messages
        still = still + 1 if n == last else 0
        last = n
    grown = rss_mb() - before
    proc.communicate("", timeout=30)
    pub.shutdown()
    return grown, last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[5, 20, 40])
    ap.add_argument("--buffer", type=int, default=2000)
    args = ap.parse_args()
    print(f"buffer_steps={args.buffer}, ~10 kB messages; RSS growth of the publisher's process")
    print(f"{'clients':>8}  {'setting':<34} {'MB':>8} {'messages queued':>16}")
    for n in args.clients:
        for name, window, cap in (
            ("coalesce defaults (256, 32 conns)", None, None),
            ("vLLM's HWM 2*(buffer+1), no cap", 2 * (args.buffer + 1), 10_000),
        ):
            grown, msgs = run(n, args.buffer, window, cap)
            print(f"{n:>8}  {name:<34} {grown:>8.1f} {msgs:>16,}")


if __name__ == "__main__":
    with recording("replay", __doc__ or ""):
        main()
