"""The tests' port picker: ports outside the kernel's ephemeral range, never handed out twice.

A port from bind(0) lies in the range the kernel also gives to outgoing connections; the fleet
test (a dozen servers, two Prometheus servers scraping) failed in CI when an agent's webhook
port had meanwhile become a scrape connection's local port.
"""

from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(__file__))
from helpers_targets import _ephemeral_range, free_port  # noqa: E402


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))

