"""A worker serves at its configured nice value, on every thread (engine/worker_priority.py).

Run in a child process started at nice 15, as Ray starts workers: this one's nice value
must stay as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine import worker_priority

PROBE = """
import json, os, sys, threading
from engine import worker_priority
started = threading.Event()
threading.Thread(target=lambda: (started.set(), threading.Event().wait(5)), daemon=True).start()
started.wait()  # a thread started before: it has the start's nice value too
target = None if sys.argv[1] == "none" else int(sys.argv[1])
report = worker_priority.serve_at(target)
print(json.dumps({**report, "threads": list(worker_priority.thread_niceness())}))
"""


def run_probe(target: str) -> dict:
    done = subprocess.run(
        ["nice", "-n", "15", sys.executable, "-c", PROBE, target],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_ready_worker_serves_at_its_configured_nice_value_on_every_thread():
    may_lower = worker_priority._may_lower_to(2)
    report = run_probe("2")
    assert report["niceness_at_start"] == 15
    expected = 2 if may_lower else 15  # without CAP_SYS_NICE it warns and stays
    assert report["niceness_serving"] == expected
    assert report["threads"] == [expected] * len(report["threads"]) and len(report["threads"]) >= 2


def test_none_leaves_the_start_value():
    report = run_probe("none")
    assert report["niceness_at_start"] == report["niceness_serving"] == 15
