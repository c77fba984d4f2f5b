"""Engine samples in, catalogue series and pass-through families out: the mapping tables applied.

Pure functions over plain data, so the tables are tested without a process, a socket or a file.
An engine's exposition is a list of :class:`Family` (what prometheus_client's parser yields and
what :mod:`.mpfiles` builds from multiprocess files); :func:`translate` returns the catalogue
series of :mod:`.maps` as :class:`easymats.segment.Series`, and every sample no rule consumed,
still grouped in its family, for the pass-through.
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

from .. import catalogue
from ..logwriter import series_key
from ..segment import Series
from .maps import EngineMap, Rule, Term

LabelsKey = tuple[tuple[str, str], ...]


class Sample(NamedTuple):
    name: str  # the sample's own name: ``x_total``, ``x_bucket``, ``x``
    labels: dict[str, str]
    value: float


class Family(NamedTuple):
    """One metric family of an engine: name, Prometheus type, help text and its samples."""

    name: str
    type: str  # counter | gauge | histogram | summary | untyped | info | stateset | gaugehistogram | unknown
    help: str
    samples: list[Sample]


class Translation(NamedTuple):
    series: list[Series]  # catalogue series, labels as the catalogue defines them
    passthrough: list[Family]  # unconsumed samples, in their engine families
    logged: dict[str, float]  # the engine's HiSparse pass-through samples, by series key
    used: dict[str, int]  # catalogue series -> the way (index) that produced it


def _key(labels: dict[str, str]) -> LabelsKey:
    return tuple(sorted(labels.items()))


def _index(families: Iterable[Family]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for fam in families:
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def term_value(samples: list[Sample], term: Term, replica_labels: tuple[str, ...]
               ) -> tuple[float, list[Sample]] | None:
    """The term's value over the matching samples, and those samples; None if none match.

    Samples that differ only in replica labels are copies of one value (each tensor-parallel rank
    of one replica reports the same pool): the largest is taken. The remaining groups are
    separate pools or engines (data-parallel ranks) and are summed.
    """
    match = term.match
    hit = [s for s in samples if all(s.labels.get(k) == v for k, v in match)] if match else samples
    if not hit:
        return None
    if not replica_labels:
        return math.fsum(s.value for s in hit), hit
    groups: dict[LabelsKey, float] = {}
    for s in hit:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k not in replica_labels))
        prev = groups.get(key)
        groups[key] = s.value if prev is None or s.value > prev else prev
    return math.fsum(groups.values()), hit


def _apply(rule: Rule, index: dict[str, list[Sample]], replica_labels: tuple[str, ...]
           ) -> tuple[float, int, list[Sample]] | None:
    """(value, way index, consumed samples) of the first complete way, or None."""
    for i, way in enumerate(rule.ways):
        total, consumed = 0.0, []
        for term in way:
            got = term_value(index.get(term.sample, []), term, replica_labels)
            if got is None:
                break
            total += term.sign * got[0]
            consumed.extend(got[1])
        else:
            return total, i, consumed
    return None


def translate(emap: EngineMap | None, families: list[Family]) -> Translation:
    """Apply ``emap`` to an engine's families (``None``: an unrecognised engine, all passed through)."""
    series: list[Series] = []
    used: dict[str, int] = {}
    consumed: set[int] = set()  # id() of consumed Sample objects: identity, not equality
    if emap is not None:
        index = _index(families)
        for r in emap.rules:
            got = _apply(r, index, emap.replica_labels)
            if got is None:
                continue
            value, way, samples = got
            spec = catalogue.CATALOGUE[r.metric]
            typ = catalogue.GAUGE if spec.type == catalogue.INFO else spec.type
            series.append(Series(r.metric, typ, spec.unit, dict(r.labels), float(value)))
            used[r.series] = way
            consumed.update(id(s) for s in samples)
    logged_names = emap.hisparse_passthrough if emap is not None else frozenset()
    # A mapped counter's creation-time twin (prometheus_client's ``x_created`` family) goes with it.
    mapped_families = {fam.name for fam in families if consumed and any(id(s) in consumed for s in fam.samples)}
    passthrough, logged = [], {}
    for fam in families:
        if fam.name in catalogue.CATALOGUE:
            continue  # never let an engine series shadow a catalogue family
        if fam.name.endswith("_created") and fam.name[:-len("_created")] in mapped_families:
            continue
        rest = [s for s in fam.samples if id(s) not in consumed] if consumed else fam.samples
        if not rest:
            continue
        passthrough.append(fam if len(rest) == len(fam.samples) else fam._replace(samples=rest))
        for s in rest:
            if s.name in logged_names:
                logged[series_key(s.name, s.labels)] = s.value
    return Translation(series, passthrough, logged, used)
