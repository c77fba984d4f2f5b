"""The Alertmanager webhook receiver: recalibration on request.

Off by default; ``easymats --webhook-listen HOST:PORT --webhook-token-file FILE`` turns it on. It
accepts Alertmanager's version 4 payloads. For each firing alert labelled ``action="recalibrate"``
it maps the alert's ``target`` label (the runtime's declared segment name, or its pid) to that
runtime's control file and writes a recalibration request there, within the request: the answer
says what was written. Status codes:

- 200: every request written (or nothing to do: resolved alerts, other actions, repeats);
- 400 malformed payload, 401 missing or wrong bearer token, 404 an alert names a target this
  agent does not watch, 413 body over 1 MiB (Alertmanager does not retry a 4xx);
- 503: a request could not be written (the control file is missing or not one the agent may
  trust); Alertmanager retries, and the repeat is acted on, since only a written request counts
  as done;
- 500: a bug in the receiver (logged with its traceback), also retried.

Each alert acts once per (fingerprint, startsAt): Alertmanager's repeats of a still-firing alert
are answered without another request. The token is checked before the body is read. Counters
``easymats_webhook_requests_total{code}``, ``easymats_recalibration_requests_total{target}`` and
``easymats_webhook_write_failures_total{target}`` (``target`` is the runtime's declared name,
however the alert named it) are exported through the agent's registry by
:class:`WebhookCollector`.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Iterator

from .control import RECALIBRATE, ControlFile
from .httpserve import MAX_CONNECTIONS, TIMEOUT_S, BoundedServer, serve_in_thread
from .usage import UsageFailure, parse_listen

log = logging.getLogger("easymats.webhook")

ACTION = RECALIBRATE
DRAIN_BYTES = 8 << 20  # an oversized body up to this size is read and dropped before the 413
MAX_BODY_BYTES = 1 << 20
REMEMBERED_ALERTS = 4096  # (fingerprint, startsAt) keys kept for idempotency, oldest dropped first
# After a 401 the body is not read; this much of it is drained (briefly) so that the client can
# read the answer instead of a connection reset.
LINGER_BYTES = 64 << 10
LINGER_S = 0.2

# target label of an alert -> (the target's declared name, its control file), or None if unknown.
Resolver = Callable[[str], "tuple[str, str] | None"]


class PayloadError(ValueError):
    """The body is not an Alertmanager version 4 payload; the message says what is wrong."""


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
    except RecursionError:  # e.g. 100,000 '[': the decoder recurses once per level
        raise PayloadError("body is nested too deeply to be an Alertmanager payload") from None
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
        if (alert["status"] == "firing" and labels.get("action") == ACTION
                and not labels.get("target")):
            raise PayloadError(f"alerts[{i}] ({labels.get('alertname', '?')}) has no 'target' label; "
                               "the alert rule must keep it")
    return alerts


class Webhook:
    """The receiver's logic and state; :meth:`serve` puts it behind HTTP."""

    def __init__(self, resolve: Resolver, token: str, requester: str = "alertmanager"):
        if not token:
            raise ValueError("the webhook needs a non-empty bearer token")
        self._resolve = resolve
        self._token = token.encode()
        self._requester = requester
        self._lock = threading.Lock()  # counters
        self._write_lock = threading.Lock()  # the seen-set and the writes it guards
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._codes: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self.version = 0  # bumped with every counter change (lets /metrics reuse a rendering)
        self._server: BoundedServer | None = None
        self.port: int | None = None

    # -- the decision, without HTTP ------------------------------------------------------------------
    def authorized(self, authorization: str | None) -> bool:
        """``Authorization: Bearer <token>``; the scheme is case-insensitive (RFC 7235), the token
        compared in constant time: it is the only thing between the network and the runtime."""
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        same = hmac.compare_digest(credentials.strip().encode(), self._token)
        return same and scheme.lower() == "bearer"

    def count(self, code: int) -> None:
        with self._lock:
            self._codes[str(code)] = self._codes.get(str(code), 0) + 1
            self.version += 1

    def handle(self, authorization: str | None, body: bytes) -> Outcome:
        """Decide one call and write its requests; counts the status code."""
        if not self.authorized(authorization):
            outcome = Outcome(401, {"error": "missing or wrong bearer token (Authorization: Bearer ...)"})
        else:
            try:
                outcome = self._act(parse_alerts(body))
            except PayloadError as exc:
                outcome = Outcome(400, {"error": str(exc)})
        self.count(outcome.code)
        return outcome

    def _act(self, alerts: list[dict[str, Any]]) -> Outcome:
        requested: list[str] = []
        failed: list[dict[str, str]] = []
        unknown: list[str] = []
        duplicates = ignored = 0
        for alert in alerts:
            labels = alert["labels"]
            if alert["status"] != "firing" or labels.get("action") != ACTION:
                ignored += 1
                continue
            resolved = self._resolve(labels["target"])
            if resolved is None:
                unknown.append(labels["target"])
                continue
            name, path = resolved
            key = (alert.get("fingerprint") or json.dumps(labels, sort_keys=True), alert.get("startsAt", ""))
            with self._write_lock:
                if key in self._seen:
                    duplicates += 1
                    continue
                error = self._write_request(name, path, f"{labels.get('alertname', 'alert')} {key[0]}")
                if error is not None:
                    failed.append({"target": name, "error": error})
                    continue
                # Remembered only once written: a repeat of a failed request is acted on.
                self._seen[key] = None
                while len(self._seen) > REMEMBERED_ALERTS:
                    self._seen.popitem(last=False)
            requested.append(name)
        body: dict[str, Any] = {"requested": requested, "duplicates": duplicates, "ignored": ignored}
        if failed:
            why = "; ".join(f"{f['target']}: {f['error']}" for f in failed)
            return Outcome(503, {**body, "failed": failed, "error": f"could not write the recalibration "
                                 f"request ({why}); answered 503 so that Alertmanager retries"})
        if unknown:
            return Outcome(404, {**body, "error": f"unknown target(s) {', '.join(sorted(set(unknown)))}: "
                                 "not attached to this easymats agent (check the alert's target label "
                                 "and the agent's --pid)"})
        return Outcome(200, body)

    def _write_request(self, name: str, path: str, reason: str) -> str | None:
        """Write one request into the control file at ``path``; None, or why it failed."""
        ctl = None
        try:
            ctl = ControlFile.open_existing(path)
            req_id = ctl.request(ACTION, reason, self._requester)
        except (OSError, ValueError) as exc:
            error = getattr(exc, "strerror", None) or str(exc)
            if isinstance(exc, FileNotFoundError):
                error = f"{path} does not exist (the runtime closed its telemetry or exited)"
            with self._lock:
                self._failures[name] = self._failures.get(name, 0) + 1
                self.version += 1
            log.warning("cannot ask %s to recalibrate: %s", name, error)
            return error
        finally:
            if ctl is not None:
                ctl.close()
        with self._lock:
            self._requests[name] = self._requests.get(name, 0) + 1
            self.version += 1
        log.info("asked %s to recalibrate (request %d: %s)", name, req_id, reason)
        return None

    def counts(self) -> dict[str, dict[str, int]]:
        """{"requests_by_code": {...}, "recalibrations_by_target": {...}, "write_failures": {...}}."""
        with self._lock:
            return {"requests_by_code": dict(self._codes),
                    "recalibrations_by_target": dict(self._requests),
                    "write_failures": dict(self._failures)}

    # -- HTTP ----------------------------------------------------------------------------------------
    def serve(self, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
              timeout_s: float = TIMEOUT_S) -> "Webhook":
        """Listen on host:port (0 picks a free port, see :attr:`port`) in a background thread;
        at most ``max_connections`` served at once, each request within ``timeout_s``."""
        server = BoundedServer((host, port), _handler(self), max_connections=max_connections,
                               timeout_s=timeout_s)
        self._server = server
        self.port = server.server_port
        serve_in_thread(server, "easymats-webhook-http")
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _drop(read: Callable[[int], bytes], left: int) -> None:
    """Read and discard up to ``left`` bytes with ``read`` (fewer at end of stream)."""
    while left > 0:
        chunk = read(min(left, 1 << 16))
        if not chunk:
            break
        left -= len(chunk)


# A class factory: its length is the handler class it defines (methods of at most ~35 lines each).
def _handler(hook: Webhook) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "easymats-webhook"
        protocol_version = "HTTP/1.1"
        # Headers and body leave in one segment (buffered, flushed after each request) and
        # without Nagle: on a keep-alive connection a split reply waits ~40 ms for delayed ACKs.
        wbufsize = 1 << 16
        disable_nagle_algorithm = True

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if not hook.authorized(self.headers.get("Authorization")):
                # Nothing of the body is read for a caller without the token.
                hook.count(401)
                self._reply(Outcome(401, {"error": "missing or wrong bearer token (Authorization: Bearer ...)"}),
                            close=True)
                self._linger()
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY_BYTES:
                if MAX_BODY_BYTES < length <= DRAIN_BYTES:
                    # Read and drop the body so the client finishes sending and reads the 413,
                    # instead of failing with a broken pipe.
                    _drop(self.rfile.read, length)
                code = 413 if length > 0 else 400
                hook.count(code)
                self._reply(Outcome(code, {"error": f"body must be 0..{MAX_BODY_BYTES} bytes with a "
                                                    "Content-Length"}), close=True)
                return
            body = self.rfile.read(length)
            if len(body) < length:  # the client went away or timed out mid-body
                self.close_connection = True
                return
            try:
                outcome = hook.handle(self.headers.get("Authorization"), body)
            except Exception:  # a bug must be an answer Alertmanager retries, not a dropped connection
                log.exception("the webhook failed on a request")
                hook.count(500)
                outcome = Outcome(500, {"error": "internal error in the easymats webhook (see its log)"})
            self._reply(outcome)

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
            if hook._server is not None:
                hook._server.renew(self.connection)

        def _linger(self) -> None:
            """Send the answer, then read (and drop) a little of an unread body before closing:
            closing with unread data resets the connection, and the client would lose the answer."""
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(LINGER_S)
                _drop(self.connection.recv, LINGER_BYTES)
            except OSError:
                pass

        def log_message(self, format: str, *args: Any) -> None:  # the agent owns stdout
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


class WebhookCollector:
    """Exports the webhook's counters (register it in the agent's CollectorRegistry)."""

    def __init__(self, hook: Webhook):
        self._hook = hook

    def describe(self) -> list:
        return list(self._families({"requests_by_code": {}, "recalibrations_by_target": {},
                                    "write_failures": {}}))

    def collect(self) -> Iterator:
        return self._families(self._hook.counts())

    def version(self) -> int:
        return self._hook.version

    @staticmethod
    def _families(counts: dict[str, dict[str, int]]) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        from . import catalogue

        spec = catalogue.get("easymats_webhook_requests_total")
        fam = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
        for code, n in sorted(counts["requests_by_code"].items()):
            fam.add_metric([code], n)
        yield fam
        for name, key in (("easymats_recalibration_requests_total", "recalibrations_by_target"),
                          ("easymats_webhook_write_failures_total", "write_failures")):
            spec = catalogue.get(name)
            fam = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
            for target, n in sorted(counts[key].items()):
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
    hook = Webhook(agent.resolve, read_token(token_file))
    hook.serve(*addr)
    registry = getattr(agent, "registry", None)
    if registry is not None:
        registry.register(WebhookCollector(hook))
    agent.webhook = hook  # kept reachable for the agent's lifetime (and for tests)
    return hook
