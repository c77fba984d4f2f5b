"""Mistakes a user can fix on the command line: the one exception every command raises for
them, and the option parsers shared by the agent, the webhook and the demo.

A module of its own so that the commands (``easymats.cli``, ``easymats.webhook``,
``easymats.demo``) can all use it without importing one another.
"""

from __future__ import annotations

from typing import Any

import click

DEFAULT_LISTEN = "127.0.0.1:9464"
INTERVAL_MIN_S = 0.01
INTERVAL_MAX_S = 60.0


class UsageFailure(click.ClickException):
    """A mistake the user can fix: one line on stderr, exit status 2, never a traceback."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"easymats: {self.format_message()}", err=True)


def parse_listen(value: str | None, option: str = "--listen") -> tuple[str, int] | None:
    """``HOST:PORT`` -> (host, port); ``''`` or ``none`` -> None (off)."""
    if value is None or value.strip().lower() in ("", "none", "off"):
        return None
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageFailure(f"{option} {value!r} is not HOST:PORT (e.g. {DEFAULT_LISTEN}; "
                           f"'none' turns it off)")
    return host or "0.0.0.0", int(port)


def check_interval(value: float, option: str = "--interval") -> float:
    if not INTERVAL_MIN_S <= value <= INTERVAL_MAX_S:
        raise UsageFailure(f"{option} {value:g} is out of range: allowed {INTERVAL_MIN_S:g}.."
                           f"{INTERVAL_MAX_S:g} seconds")
    return value
