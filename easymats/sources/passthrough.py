"""The engine series no table maps, on the agent's ``/metrics`` under the engine's own names.

Every sample keeps its name and labels and gains the agent's ``target`` label (an engine label
already called ``target`` is kept as ``exported_target``, as Prometheus does on a clash). Families
of the same name from several targets are written once, under one HELP and TYPE; a target whose
family has another type than the first target's is left out of that family, with one warning.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ..logwriter import escape_label_value
from .translate import Family

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("easymats.exporter")
_warned: set[str] = set()


def _labels(labels: dict[str, str], target: str) -> str:
    items = [(("exported_target" if k == "target" else k), v) for k, v in labels.items()]
    items.append(("target", target))
    return "{" + ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in items) + "}"


def _type_name(fam: Family) -> tuple[str, str]:
    """(name on the TYPE line, type) in the text format 0.0.4, as prometheus_client writes it."""
    typ = fam.type if fam.type in ("counter", "gauge", "histogram", "summary") else "untyped"
    if typ == "counter" and all(s.name == fam.name + "_total" for s in fam.samples):
        return fam.name + "_total", typ
    return fam.name, typ


def grouped(targets: Iterable[object]) -> dict[str, tuple[str, str, str, list[tuple[str, Family]]]]:
    """family name -> (TYPE name, type, help, [(target name, family)]), in first-seen order."""
    out: dict[str, tuple[str, str, str, list[tuple[str, Family]]]] = {}
    for tg in targets:
        fams = getattr(tg, "passthrough", None)
        if not fams:
            continue
        name = getattr(tg, "name", "?")
        for fam in fams:
            type_name, typ = _type_name(fam)
            got = out.get(fam.name)
            if got is None:
                out[fam.name] = (type_name, typ, fam.help, [(name, fam)])
            elif got[1] != typ:
                key = f"{name}/{fam.name}"
                if key not in _warned:
                    _warned.add(key)
                    log.warning("target %s: %s has type %s, another target's has %s; left out of /metrics",
                                name, fam.name, typ, got[1])
            else:
                got[3].append((name, fam))
    return out


def render(targets: Iterable[object], fv: Callable[[float], str]) -> str:
    """The pass-through families of ``targets`` in the text format 0.0.4, each value written by
    ``fv`` (the exporter's number format)."""
    parts = []
    for type_name, typ, help_text, members in grouped(targets).values():
        doc = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        parts.append(f"# HELP {type_name} {doc}\n# TYPE {type_name} {typ}\n")
        for target, fam in members:
            parts.extend(f"{s.name}{_labels(s.labels, target)} {fv(s.value)}\n" for s in fam.samples)
    return "".join(parts)


def families(targets: Iterable[object]) -> Iterator[Metric]:
    """The same as prometheus_client Metric objects, for the collector protocol."""
    from prometheus_client.core import Metric

    for type_name, typ, help_text, members in grouped(targets).values():
        base = type_name[:-len("_total")] if typ == "counter" and type_name.endswith("_total") else type_name
        m = Metric(base, help_text, "unknown" if typ == "untyped" else typ)
        for target, fam in members:
            for s in fam.samples:
                labels = {("exported_target" if k == "target" else k): v for k, v in s.labels.items()}
                labels["target"] = target
                m.add_sample(s.name, labels, s.value)
        yield m
