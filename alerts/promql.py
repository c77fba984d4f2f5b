"""Metric names in a PromQL expression, and the check that each one is defined somewhere.

Used by ``alerts/build.py --check`` and ``dashboards/build.py --check``: every name a rule or a
panel queries must be a catalogue metric (``easymats/catalogue.py``; histograms also as
``_bucket``/``_sum``/``_count``), a recording rule from ``alerts/rules.yml`` or one of the few
series Prometheus makes itself. This is a lexical scan, not a parser: it is exact for the
expressions this project writes (selectors, functions, aggregations with label lists, binary
operators with matching modifiers) and errs towards reporting a name, never towards hiding one.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

# Series that Prometheus itself produces for every scrape or rule evaluation.
PROMETHEUS_BUILTINS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                                 "ALERTS", "ALERTS_FOR_STATE"})

_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                       "and", "or", "unless", "offset", "inf", "nan", "atan2", "start", "end"})
# Keywords followed by a parenthesised list of label names, not of expressions.
_LABEL_LIST_KEYWORDS = ("by", "without", "on", "ignoring", "group_left", "group_right")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _strip_enclosed(text: str, open_: str, close: str) -> str:
    """Remove every ``open_ ... close`` span (label matchers, range selectors); no nesting."""
    return re.sub(re.escape(open_) + r"[^" + re.escape(close) + r"]*" + re.escape(close), " ", text)


def _strip_label_lists(text: str) -> str:
    pattern = re.compile(r"\b(" + "|".join(_LABEL_LIST_KEYWORDS) + r")\s*\([^()]*\)")
    return pattern.sub(" ", text)


def metric_names(expr: str) -> list[str]:
    """The metric (and recording rule) names that ``expr`` selects, in order, without repeats."""
    text = _STRING.sub(" ", expr)
    text = _strip_enclosed(text, "{", "}")
    text = _strip_enclosed(text, "[", "]")
    text = _strip_label_lists(text)
    names: list[str] = []
    for m in _IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if rest.startswith("("):  # a function or aggregation call
            continue
        if word in _KEYWORDS or word in names:
            continue
        names.append(word)
    return names


def undefined_names(expr: str, catalogue: Mapping[str, object], recording_rules: Iterable[str]) -> list[str]:
    """Names in ``expr`` that neither the catalogue, the recording rules nor Prometheus define."""
    rules = set(recording_rules)
    bad = []
    for name in metric_names(expr):
        if name in catalogue or name in rules or name in PROMETHEUS_BUILTINS:
            continue
        base = next((name[: -len(s)] for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        spec = catalogue.get(base) if base else None
        if spec is not None and getattr(spec, "type", None) == "histogram":
            continue
        bad.append(name)
    return bad
