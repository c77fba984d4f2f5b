"""``easymats report`` and ``easymats doctor``: turn a recorded run (or a live one) into findings.

Modules, one job each:

- :mod:`.reader`   streams the JSON Lines log (rotated files oldest first) in bounded memory.
- :mod:`.derive`   turns counters into rates and ratios over a sliding window; a counter that goes
  backwards or a new pid is a target restart.
- :mod:`.accum`    bounded-memory accumulators: quantile sketch, min/max downsampler, episodes.
- :mod:`.analyse`  one pass over the samples: per target accumulators and markers.
- :mod:`.findings` the diagnosis rules, each a small function returning evidence and a change.
- :mod:`.plots`    matplotlib (Agg, imported lazily) figures with thresholds and markers.
- :mod:`.html`     the self-contained report page.
- :mod:`.live`     samples a live segment for ``doctor``.
- :mod:`.cli`      the click commands.

Nothing here imports torch; matplotlib is imported only when plots are drawn.
"""
