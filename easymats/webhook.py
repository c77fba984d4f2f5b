"""Recalibration on request: the Alertmanager webhook receiver and ``easymats recalibrate``.

The webhook (off by default; ``easymats --webhook-listen HOST:PORT --webhook-token-file FILE``)
accepts Alertmanager's version 4 payloads. For each firing alert labelled
``action="recalibrate"`` it maps the alert's ``target`` label (the runtime's declared segment
name, or a pid) to that runtime's control file and writes a recalibration request. It answers
within the request: the handler only validates and queues, one worker thread writes the control
files. Status codes: 200 done or nothing to do, 400 malformed payload, 401 missing or wrong bearer
token, 404 an alert names a target this agent does not watch (Alertmanager does not retry 4xx),
413 body over 1 MiB. Each alert acts once per (fingerprint, startsAt): Alertmanager's repeats of
a still-firing alert are acknowledged without another request. Resolved alerts are ignored.

Counters ``easymats_webhook_requests_total{code}`` and
``easymats_recalibration_requests_total{target}`` are exported through the agent's registry by
:class:`WebhookCollector`; :meth:`Webhook.counts` reads them directly.

``easymats recalibrate --pid N`` writes the same request by hand and waits for the runtime's
acknowledgement.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

import click

from .segment import SegmentError, control_path, read_segment, require_segments
from .usage import UsageFailure, parse_listen
from .control import ControlFile

log = logging.getLogger("easymats.webhook")

ACTION = "recalibrate"
DRAIN_BYTES = 8 << 20  # an oversized body up to this size is read and dropped before the 413
MAX_BODY_BYTES = 1 << 20
REMEMBERED_ALERTS = 4096  # (fingerprint, startsAt) keys kept for idempotency, oldest dropped first
DEFAULT_TIMEOUT_S = 10.0

Resolver = Callable[[str], "str | None"]


class PayloadError(ValueError):
    """The body is not an Alertmanager version 4 payload; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Job:
    target: str
    control_path: str
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one webhook call did: the HTTP status and a JSON body saying why."""
    code: int
    body: dict[str, Any]


def parse_alerts(body: bytes) -> list[dict[str, Any]]:
    """The alerts of a version 4 payload, each checked for the fields this receiver uses."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise PayloadError("body is not a JSON object")
    if payload.get("version") != "4":
        raise PayloadError(f"unsupported payload version {payload.get('version')!r}; expected \"4\" "
                           "(Alertmanager webhook_config)")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("'alerts' is missing or not a list")
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict):
            raise PayloadError(f"alerts[{i}] is not an object")
        if alert.get("status") not in ("firing", "resolved"):
            raise PayloadError(f"alerts[{i}].status is {alert.get('status')!r}, not firing or resolved")
        labels = alert.get("labels")
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise PayloadError(f"alerts[{i}].labels is missing or not an object of strings")
        for key in ("fingerprint", "startsAt"):
            if not isinstance(alert.get(key, ""), str):
                raise PayloadError(f"alerts[{i}].{key} is not a string")
    return alerts


class Webhook:
    """The receiver's logic and state; :meth:`serve` puts it behind HTTP.

    ``resolve(target)`` returns the control-file path of a watched target, or None.
    """

    def __init__(self, resolve: Resolver, token: str, requester: str = "alertmanager"):
        if not token:
            raise ValueError("the webhook needs a non-empty bearer token")
        self._resolve = resolve
        self._expected = f"Bearer {token}".encode()
        self._requester = requester
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._codes: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._failures = 0
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="easymats-webhook", daemon=True)
        self._worker.start()
        self._server: ThreadingHTTPServer | None = None
        self.port: int | None = None

    # -- the decision, without HTTP ------------------------------------------------------------------
    def handle(self, authorization: str | None, body: bytes) -> Outcome:
        """Decide one call and queue its work; counts the status code."""
        outcome = self._decide(authorization, body)
        with self._lock:
            key = str(outcome.code)
            self._codes[key] = self._codes.get(key, 0) + 1
        return outcome

    def _decide(self, authorization: str | None, body: bytes) -> Outcome:
        # Compare in constant time: the token is the only thing between the network and the runtime.
        if not hmac.compare_digest((authorization or "").encode(), self._expected):
            return Outcome(401, {"error": "missing or wrong bearer token (Authorization: Bearer ...)"})
        try:
            alerts = parse_alerts(body)
        except PayloadError as exc:
            return Outcome(400, {"error": str(exc)})
        queued, duplicates, ignored, unknown = [], 0, 0, []
        for i, alert in enumerate(alerts):
            labels = alert["labels"]
            if alert["status"] != "firing" or labels.get("action") != ACTION:
                ignored += 1
                continue
            target = labels.get("target", "")
            if not target:
                return Outcome(400, {"error": f"alerts[{i}] ({labels.get('alertname', '?')}) has no "
                                              "'target' label; the alert rule must keep it"})
            path = self._resolve(target)
            if path is None:
                unknown.append(target)
                continue
            key = (alert.get("fingerprint") or json.dumps(labels, sort_keys=True), alert.get("startsAt", ""))
            with self._lock:
                if key in self._seen:
                    duplicates += 1
                    continue
                self._seen[key] = None
                while len(self._seen) > REMEMBERED_ALERTS:
                    self._seen.popitem(last=False)
            reason = f"{labels.get('alertname', 'alert')} {key[0]}"
            self._jobs.put(Job(target, path, reason))
            queued.append(target)
        body_out = {"queued": queued, "duplicates": duplicates, "ignored": ignored}
        if unknown:
            return Outcome(404, {**body_out, "error": f"unknown target(s) {', '.join(sorted(set(unknown)))}: "
                                 "not attached to this easymats agent (check the alert's target label "
                                 "and the agent's --pid)"})
        return Outcome(200, body_out)

    # -- the work ------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._write_request(job)
            finally:
                self._jobs.task_done()

    def _write_request(self, job: Job) -> None:
        ctl = None
        try:
            ctl = ControlFile.open_existing(job.control_path)
            req_id = ctl.request(ACTION, job.reason, self._requester)
        except (OSError, ValueError) as exc:
            with self._lock:
                self._failures += 1
            log.warning("cannot ask %s to recalibrate: %s", job.target, exc)
            return
        finally:
            if ctl is not None:
                ctl.close()
        with self._lock:
            self._requests[job.target] = self._requests.get(job.target, 0) + 1
        log.info("asked %s to recalibrate (request %d: %s)", job.target, req_id, job.reason)

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every queued request is written (tests and shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def counts(self) -> dict[str, dict[str, int]]:
        """{"requests_by_code": {...}, "recalibrations_by_target": {...}, "write_failures": {"": n}}."""
        with self._lock:
            return {"requests_by_code": dict(self._codes),
                    "recalibrations_by_target": dict(self._requests),
                    "write_failures": {"": self._failures}}

    # -- HTTP ----------------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> "Webhook":
        """Listen on host:port (0 picks a free port, see :attr:`port`) in a background thread."""
        hook = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "easymats-webhook"
            protocol_version = "HTTP/1.1"
            # Headers and body leave in one segment (buffered, flushed after each request) and
            # without Nagle: on a keep-alive connection a split reply waits ~40 ms for delayed ACKs.
            wbufsize = 1 << 16
            disable_nagle_algorithm = True

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_BODY_BYTES:
                    if MAX_BODY_BYTES < length <= DRAIN_BYTES:
                        # Read and drop the body so the client finishes sending and reads the 413,
                        # instead of failing with a broken pipe.
                        left = length
                        while left > 0:
                            chunk = self.rfile.read(min(left, 1 << 16))
                            if not chunk:
                                break
                            left -= len(chunk)
                    with hook._lock:
                        hook._codes["413" if length > 0 else "400"] = hook._codes.get(
                            "413" if length > 0 else "400", 0) + 1
                    self._reply(Outcome(413 if length > 0 else 400,
                                        {"error": f"body must be 0..{MAX_BODY_BYTES} bytes with a Content-Length"}),
                                close=True)
                    return
                body = self.rfile.read(length)
                self._reply(hook.handle(self.headers.get("Authorization"), body))

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/") in ("/healthz", ""):
                    self._reply(Outcome(200, {"status": "ok", "post": "Alertmanager webhook payloads"}))
                else:
                    self._reply(Outcome(404, {"error": "POST Alertmanager payloads here; GET /healthz"}))

            def _reply(self, outcome: Outcome, close: bool = False) -> None:
                data = json.dumps(outcome.body).encode() + b"\n"
                self.send_response(outcome.code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if outcome.code == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="easymats"')
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # the agent owns stdout
                log.debug("%s " + format, self.address_string(), *args)

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name="easymats-webhook-http", daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._jobs.put(None)


class WebhookCollector:
    """Exports the webhook's counters (register it in the agent's CollectorRegistry)."""

    def __init__(self, hook: Webhook):
        self._hook = hook

    def describe(self) -> list:
        return list(self._families({"requests_by_code": {}, "recalibrations_by_target": {}}))

    def collect(self) -> Iterator:
        return self._families(self._hook.counts())

    @staticmethod
    def _families(counts: dict[str, dict[str, int]]) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        from . import catalogue

        spec = catalogue.get("easymats_webhook_requests_total")
        fam = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
        for code, n in sorted(counts["requests_by_code"].items()):
            fam.add_metric([code], n)
        yield fam
        spec = catalogue.get("easymats_recalibration_requests_total")
        fam = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
        for target, n in sorted(counts["recalibrations_by_target"].items()):
            fam.add_metric([target], n)
        yield fam


def read_token(token_file: str | None) -> str:
    """The bearer token from ``token_file`` (surrounding whitespace stripped); UsageFailure if unusable."""
    if not token_file:
        raise UsageFailure("--webhook-listen needs --webhook-token-file FILE: a file holding the bearer "
                           "token that Alertmanager sends (http_config.authorization.credentials_file)")
    try:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageFailure(f"--webhook-token-file {token_file}: cannot read it "
                           f"({getattr(exc, 'strerror', None) or exc})") from None
    if not token or any(c.isspace() for c in token):
        raise UsageFailure(f"--webhook-token-file {token_file}: must hold one token without spaces "
                           "(e.g. openssl rand -hex 32 > FILE)")
    return token


def start_webhook(listen: str, token_file: str | None, agent: Any) -> Webhook:
    """Serve the webhook for ``agent`` on ``listen`` (HOST:PORT) and export its counters.

    Raises UsageFailure for a bad address or token file, OSError when the port cannot be bound.
    """
    addr = parse_listen(listen, "--webhook-listen")
    if addr is None:
        raise ValueError("start_webhook needs HOST:PORT")
    hook = Webhook(agent.resolve_target, read_token(token_file))
    hook.serve(*addr)
    registry = getattr(agent, "registry", None)
    if registry is not None:
        registry.register(WebhookCollector(hook))
    agent.webhook = hook  # kept reachable for the agent's lifetime (and for tests)
    return hook


# -- easymats recalibrate -------------------------------------------------------------------------


class RecalibrationFailed(click.ClickException):
    """The request was written but not acknowledged (in time, or successfully): exit status 1."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"easymats: {self.format_message()}", err=True)


def _control_files(pid: int) -> list[tuple[str, ControlFile]]:
    try:
        paths = require_segments(pid)
    except SegmentError as exc:
        raise UsageFailure(exc.detail) from None
    out = []
    for path in paths:
        try:
            name = read_segment(path).name
        except SegmentError as exc:
            raise UsageFailure(str(exc)) from None
        try:
            out.append((name, ControlFile.open_existing(control_path(path))))
        except FileNotFoundError:
            raise UsageFailure(f"{path} has no control file {control_path(path)}: the runtime does "
                               "not accept requests (or its segment is stale: easymats ls --clean)") from None
        except (OSError, ValueError) as exc:
            raise UsageFailure(f"cannot open {control_path(path)}: {getattr(exc, 'strerror', None) or exc}"
                               " (run easymats as the user that runs the runtime)") from None
    return out


@click.command("recalibrate")
@click.option("--pid", type=click.IntRange(min=1), required=True, help="The HiSparse process.")
@click.option("--reason", default="manual", show_default=True, help="Why (recorded by the runtime).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="Seconds to wait for the runtime's acknowledgement.")
def recalibrate(pid: int, reason: str, timeout: float) -> None:
    """Ask a runtime to recalibrate its anchors and probe, and wait for its acknowledgement."""
    files = _control_files(pid)
    t0 = time.monotonic()
    pending = []
    try:
        for name, ctl in files:
            pending.append((name, ctl, ctl.request(ACTION, reason, "cli")))
        deadline = t0 + timeout
        while pending:
            for item in list(pending):
                name, ctl, req_id = item
                ack_id, _, status = ctl.acked()
                if ack_id >= req_id:
                    pending.remove(item)
                    if status != 0:
                        raise RecalibrationFailed(f"pid {pid} ({name}) acknowledged request #{req_id} "
                                                  f"with failure status {status}; see the runtime's log")
                    click.echo(f"pid {pid} ({name}): recalibration request #{req_id} acknowledged in "
                               f"{(time.monotonic() - t0) * 1000:.0f} ms")
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{n} (request #{r})" for n, _, r in pending)
                raise RecalibrationFailed(
                    f"pid {pid} did not acknowledge {names} within {timeout:g} s: the request stays "
                    "queued; check that the runtime is decoding (it polls its control file between "
                    "steps) and not stopped, or wait longer with --timeout")
            time.sleep(0.01)
    finally:
        for _, ctl in files:
            ctl.close()
