"""Command line: ``coalesce demo`` (the seed scenario) and ``coalesce subscribe``.

``coalesce demo`` runs vLLM's stock publisher, the drop-on-full variant and
``coalesce`` under the same seeded offload workload, each rank in its own
process with a real subscriber in another, and prints one table
(:mod:`coalesce_tools.demo`, imported only for that command).
``coalesce subscribe`` follows publishers and shows live counters or one JSON
line per batch.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

DESCRIPTION = "kv-coalesce: the seed-scenario demo, and a subscriber for KV-event streams."
SUBSCRIBE_EPILOG = """examples:
  a publisher bound with endpoint="tcp://*:5557" (vLLM's default), replay on 5558:
    coalesce subscribe tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
  a publisher given endpoint="tcp://127.0.0.1:5557" connects (vLLM's rule), so bind here:
    coalesce subscribe --bind tcp://127.0.0.1:5557
  two DP ranks (ports are offset by rank):
    coalesce subscribe tcp://127.0.0.1:5557 tcp://127.0.0.1:5558
"""


def _quiet_hint(endpoints: list[str], bind: bool, after: float) -> str:
    if bind:
        return (
            f"kv-coalesce: nothing received on {', '.join(endpoints)} for {after:g} s: "
            "this subscriber binds there; is the publisher's endpoint this address "
            "(a publisher connects only when its endpoint names a host)?"
        )
    return (
        f"kv-coalesce: nothing received from {', '.join(endpoints)} for {after:g} s. "
        "This subscriber connects: the publisher must be bound there (endpoint "
        '"tcp://*:PORT"). A publisher given "tcp://HOST:PORT" connects instead (vLLM\'s rule); '
        "then run: coalesce subscribe --bind tcp://HOST:PORT"
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def subscribe(
    endpoints: list[str],
    replays: list[str],
    topic: str,
    as_json: bool,
    seconds: float | None,
    bind: bool = False,
    warn_after: float = 5.0,
    snapshots: list[str] | None = None,
) -> int:
    """Follow publishers; print live counters (or JSON lines); a summary on Ctrl-C
    or SIGTERM (``kill``, a service manager, a container's stop)."""
    from coalesce.subscriber import Source, Subscriber

    if replays and len(replays) != len(endpoints):
        raise SystemExit("--replay must be given once per ENDPOINT, or not at all")
    reps: list[str | None] = list(replays) if replays else [None] * len(endpoints)
    if snapshots and len(snapshots) != len(endpoints):
        raise SystemExit("--snapshot must be given once per ENDPOINT, or not at all")
    snaps: list[str | None] = list(snapshots) if snapshots else [None] * len(endpoints)

    def print_batch(src: Source, seq: int, ts: float, events: list[Any], rank: int | None) -> None:
        line = {
            "source": src.endpoint,
            "seq": seq,
            "ts": ts,
            "rank": rank,
            "events": [msgspec.to_builtins(e) for e in events],
        }
        print(msgspec.json.encode(line).decode(), flush=True)

    sub = Subscriber(
        endpoints,
        reps,
        topic=topic,
        on_batch=print_batch if as_json else None,
        bind=bind,
        snapshot_endpoints=snaps,
    )
    start = time.monotonic()
    deadline = None if seconds is None else start + seconds
    warned = False
    on_term = None
    if threading.current_thread() is threading.main_thread():  # (signals go to it only)
        on_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while deadline is None or time.monotonic() < deadline:
            sub.poll(0.2)
            if not warned and time.monotonic() - start > warn_after:
                warned = True
                if not any(s.messages or s.bad_messages for s in sub.sources):
                    print(
                        ("\n" if not as_json else "") + _quiet_hint(endpoints, bind, warn_after),
                        file=sys.stderr,
                        flush=True,
                    )
            if not as_json:
                s = sub.summary()
                kinds = " ".join(f"{k}={v}" for k, v in sorted(s["events"].items()))
                print(
                    f"\rmessages={s['messages']} {kinds} gaps={s['gaps']} "
                    f"replays={s['replays']} snapshots={s['snapshots']} "
                    f"recovered={s['recovered']} resets={s['resets']} "
                    f"bad={s['bad_messages']} partial={s['partial_sources']} "
                    f"index={s['index_size']}   ",
                    end="",
                    flush=True,
                )
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    print("" if as_json else "\n", end="")
    print(msgspec.json.encode({"summary": sub.summary()}).decode(), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coalesce", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="the seed scenario: vLLM's publisher, the drop fix and ours (coalesce demo --help)",
        add_help=False,
    )
    s = sub.add_parser(
        "subscribe",
        help="follow publishers: live counters, or JSON lines",
        epilog=SUBSCRIBE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "endpoint", nargs="+", help="publisher endpoint(s), one per DP rank (see the examples)"
    )
    s.add_argument(
        "--bind", action="store_true", help="bind ENDPOINT(s): for publishers that connect"
    )
    s.add_argument("--replay", action="append", default=[], help="replay endpoint, per ENDPOINT")
    s.add_argument(
        "--snapshot",
        action="append",
        default=[],
        help="snapshot endpoint (the publisher's snapshot_endpoint), per ENDPOINT: "
        "bootstrap from it, and heal gaps replay cannot fill",
    )
    s.add_argument("--topic", default="", help="topic prefix to subscribe to")
    s.add_argument("--json", action="store_true", help="one JSON line per batch")
    s.add_argument("--seconds", type=float, default=None, help="stop after this long")
    s.add_argument(
        "--warn-after",
        type=float,
        default=5.0,
        help="seconds with nothing received before saying why that may be (default 5)",
    )
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:  # the demo's tools load only when asked for
        from coalesce_tools.cli import demo_main

        return demo_main(args_list[1:])
    args = parser.parse_args(args_list)
    return subscribe(
        args.endpoint,
        args.replay,
        args.topic,
        args.json,
        args.seconds,
        bind=args.bind,
        warn_after=args.warn_after,
        snapshots=args.snapshot,
    )


if __name__ == "__main__":
    sys.exit(main())
