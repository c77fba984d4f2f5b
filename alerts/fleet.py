"""A fleet's scrape targets, Alertmanager routing and Prometheus configs from one inventory.

    python alerts/fleet.py INVENTORY.yml --out DIR

The inventory (alerts/fleet.example.yml) lists each node's easymats agent once: where Prometheus
scrapes it and where its Alertmanager webhook listens. Everything that must agree about nodes is
generated from that list, so a node added or removed changes all of it together:

- ``targets.json``: the edge Prometheus' ``file_sd_configs`` file, each agent labelled with its
  node (the label every per-target rule keeps: alerts/build.py TOPOLOGY);
- ``alertmanager.yml``: alerts/alertmanager.yml with its one recalibration receiver replaced by one
  receiver per node and a child route per node that matches the node label, so a recalibration
  alert for node B reaches only B's agent (target names repeat across nodes: routing by target
  alone would recalibrate the wrong runtime). A recalibration alert whose node is not in the
  inventory goes to the parent route's receiver (people), never to some other node;
- ``prometheus-edge.yml`` (scrapes the agents, evaluates alerts/rules.yml, alerts Alertmanager) and
  ``prometheus-global.yml`` (federates the edges' node-level series with alerts/build.py
  FEDERATE_MATCH, evaluates alerts/fleet_rules.yml), with both rule files beside them.

docs/fleet.md describes the design; tests/test_fleet.py runs it with six agents.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from alerts import build as rules  # noqa: E402

ALERTMANAGER_BASE = os.path.join(ROOT, "alerts", "alertmanager.yml")
# The receiver of alerts/alertmanager.yml that the per-node receivers replace.
RECALIBRATE_RECEIVER = "easymats-recalibrate"
ROUTE_LABELS = ("node", "pod")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
_HOST_PORT = re.compile(r"^[^\s/:]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$")


class InventoryError(ValueError):
    """The inventory is malformed; the message names the entry and the fix."""


@dataclass(frozen=True)
class Node:
    name: str  # the value of the route label (e.g. the node label from targets.json)
    metrics: str  # HOST:PORT that Prometheus scrapes
    webhook: str  # the agent's webhook URL, http(s)://HOST:PORT/alertmanager
    token_file: str  # bearer token file Alertmanager sends (the agent's --webhook-token-file)
    labels: dict[str, str] = field(default_factory=dict)  # extra target labels (rack, zone, ...)


@dataclass(frozen=True)
class Inventory:
    nodes: tuple[Node, ...]
    route_label: str = "node"


def parse_inventory(data: object, where: str = "inventory") -> Inventory:
    """Check an inventory (as loaded from YAML) and return it; InventoryError says what is wrong."""
    if not isinstance(data, dict):
        raise InventoryError(f"{where}: expected a mapping with a 'nodes' list")
    route_label = data.get("route_label", "node")
    if route_label not in ROUTE_LABELS:
        raise InventoryError(f"{where}: route_label {route_label!r} is not one of {', '.join(ROUTE_LABELS)}")
    default_token = data.get("webhook_token_file")
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise InventoryError(f"{where}: 'nodes' must be a non-empty list of {{name, metrics, webhook}}")
    nodes: list[Node] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        at = f"{where}: nodes[{i}]"
        if not isinstance(entry, dict):
            raise InventoryError(f"{at} is not a mapping")
        missing = [k for k in ("name", "metrics", "webhook") if not entry.get(k)]
        if missing:
            raise InventoryError(f"{at} lacks {', '.join(missing)} (each node needs name, metrics "
                                 "HOST:PORT and webhook URL)")
        name, metrics, webhook = str(entry["name"]), str(entry["metrics"]), str(entry["webhook"])
        if not _NAME.match(name):
            raise InventoryError(f"{at}: name {name!r} must be letters, digits and . _ : - "
                                 f"(it is the {route_label} label value)")
        if name in seen:
            raise InventoryError(f"{at}: name {name!r} appears twice; each node once")
        seen.add(name)
        if not _HOST_PORT.match(metrics):
            raise InventoryError(f"{at} ({name}): metrics {metrics!r} is not HOST:PORT")
        url = urlsplit(webhook)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise InventoryError(f"{at} ({name}): webhook {webhook!r} is not an http(s):// URL")
        token = entry.get("webhook_token_file", default_token)
        if not token:
            raise InventoryError(f"{at} ({name}): no webhook_token_file (set one for the inventory "
                                 "or the node: the agent refuses calls without its token)")
        labels = entry.get("labels") or {}
        if not isinstance(labels, dict) or route_label in labels or "job" in labels:
            raise InventoryError(f"{at} ({name}): labels must be a mapping without "
                                 f"{route_label!r} or 'job'")
        nodes.append(Node(name, metrics, webhook, str(token), {str(k): str(v) for k, v in labels.items()}))
    return Inventory(tuple(nodes), route_label)


def load_inventory(path: str) -> Inventory:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise InventoryError(f"cannot read the inventory {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path} is not YAML: {exc}") from None
    return parse_inventory(data, path)


def file_sd(inv: Inventory) -> list[dict]:
    """The file_sd_configs target groups: one per agent, labelled with its node."""
    return [{"targets": [n.metrics], "labels": {**n.labels, inv.route_label: n.name}} for n in inv.nodes]


def receiver_name(node: Node) -> str:
    return f"{RECALIBRATE_RECEIVER}-{node.name}"


def alertmanager_config(inv: Inventory, base: dict | None = None) -> dict:
    """alerts/alertmanager.yml with the recalibration route split into one child route per node."""
    if base is None:
        import yaml

        with open(ALERTMANAGER_BASE, encoding="utf-8") as f:
            base = yaml.safe_load(f)
    cfg = copy.deepcopy(base)
    routes = cfg["route"].get("routes", [])
    try:
        parent = next(r for r in routes if r.get("receiver") == RECALIBRATE_RECEIVER)
        template = next(r for r in cfg["receivers"] if r["name"] == RECALIBRATE_RECEIVER)["webhook_configs"][0]
    except StopIteration:
        raise InventoryError(f"the base Alertmanager config has no route and receiver "
                             f"{RECALIBRATE_RECEIVER!r} to split per node") from None
    # A recalibration alert for a node missing from the inventory reaches people, not another node.
    parent["receiver"] = cfg["route"]["receiver"]
    parent["routes"] = [{"receiver": receiver_name(n), "matchers": [f'{inv.route_label}="{n.name}"']}
                        for n in inv.nodes]
    receivers = [r for r in cfg["receivers"] if r["name"] != RECALIBRATE_RECEIVER]
    for n in inv.nodes:
        hook = copy.deepcopy(template)
        hook["url"] = n.webhook
        hook.setdefault("http_config", {}).setdefault("authorization", {"type": "Bearer"})
        hook["http_config"]["authorization"]["credentials_file"] = n.token_file
        receivers.append({"name": receiver_name(n), "webhook_configs": [hook]})
    cfg["receivers"] = receivers
    return cfg


def edge_prometheus_config(*, targets_file: str, alertmanagers: list[str], rule_files: list[str],
                           external_labels: dict[str, str] | None = None, scrape_interval: str = "15s",
                           evaluation_interval: str | None = None) -> dict:
    """The Prometheus next to the agents: discovers them from ``targets_file`` (file_sd)."""
    return {
        "global": {"scrape_interval": scrape_interval,
                   "evaluation_interval": evaluation_interval or scrape_interval,
                   # The cluster label reaches the global Prometheus, remote storage and
                   # Alertmanager through external_labels, never through the rules.
                   **({"external_labels": dict(external_labels)} if external_labels else {})},
        "rule_files": list(rule_files),
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]},
        "scrape_configs": [{"job_name": rules.AGENT_JOB,
                            "file_sd_configs": [{"files": [targets_file]}]}],
    }


def global_prometheus_config(*, edges: list[str], rule_files: list[str], scrape_interval: str = "30s",
                             evaluation_interval: str | None = None) -> dict:
    """The global Prometheus: federates the edges' node-level and per-target rule series."""
    return {
        "global": {"scrape_interval": scrape_interval,
                   "evaluation_interval": evaluation_interval or scrape_interval},
        "rule_files": list(rule_files),
        "scrape_configs": [{
            "job_name": "federate-easymats",
            "metrics_path": "/federate",
            # Keep the edge's job, instance and node labels (and its external cluster label)
            # instead of overwriting them with this scrape's own.
            "honor_labels": True,
            "params": {"match[]": list(rules.FEDERATE_MATCH)},
            "static_configs": [{"targets": list(edges)}],
        }],
    }


def write(inv: Inventory, out: str, *, alertmanagers: list[str], edges: list[str],
          cluster: str | None = None) -> list[str]:
    """Write every generated file into ``out``; returns their paths."""
    import yaml

    os.makedirs(out, exist_ok=True)
    paths = []

    def emit(name: str, text: str) -> None:
        path = os.path.join(out, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        paths.append(path)

    header = "# GENERATED by alerts/fleet.py from the fleet inventory: do not edit by hand.\n"
    emit("targets.json", json.dumps(file_sd(inv), indent=2) + "\n")
    emit("alertmanager.yml", header + yaml.safe_dump(alertmanager_config(inv), sort_keys=False))
    edge = edge_prometheus_config(targets_file="targets.json", alertmanagers=alertmanagers,
                                  rule_files=["rules.yml"],
                                  external_labels={"cluster": cluster} if cluster else None)
    emit("prometheus-edge.yml", header + yaml.safe_dump(edge, sort_keys=False))
    emit("prometheus-global.yml", header + yaml.safe_dump(
        global_prometheus_config(edges=edges, rule_files=["fleet_rules.yml"]), sort_keys=False))
    for src in (rules.RULES_PATH, rules.FLEET_RULES_PATH):
        dst = os.path.join(out, os.path.basename(src))
        shutil.copyfile(src, dst)
        paths.append(dst)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inventory", help="the fleet inventory (see alerts/fleet.example.yml)")
    parser.add_argument("--out", required=True, help="directory for the generated files")
    parser.add_argument("--alertmanager", action="append", default=[], metavar="HOST:PORT",
                        help="Alertmanager the edge Prometheus alerts (repeatable)")
    parser.add_argument("--edge", action="append", default=[], metavar="HOST:PORT",
                        help="edge Prometheus the global one federates (repeatable)")
    parser.add_argument("--cluster", default=None, help="the edge Prometheus' cluster external label")
    args = parser.parse_args(argv)
    try:
        inv = load_inventory(args.inventory)
    except InventoryError as exc:
        print(f"alerts/fleet.py: {exc}", file=sys.stderr)
        return 2
    for path in write(inv, args.out, alertmanagers=args.alertmanager or ["127.0.0.1:9093"],
                      edges=args.edge or ["127.0.0.1:9090"], cluster=args.cluster):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
