"""Engine sources: the HiSparse that runs inside serving engines (vLLM, SGLang), seen by easymats.

A native HiSparse process publishes a telemetry segment in the catalogue's names. Serving engines
do not: vLLM exports a few HiSparse series on its own ``/metrics`` and SGLang keeps its metrics in
prometheus_client's multiprocess files (and prints HiSparse token counts in its decode log). The
modules here turn those into the same :class:`easymats.segment.Snapshot` the agent samples from a
segment, so the log, ``/metrics``, the live view, the report, the rules and the dashboards work on
them unchanged:

- :mod:`.maps`: the declarative mapping tables, per engine and naming revision, and what each
  engine cannot provide;
- :mod:`.translate`: engine samples in, catalogue series and pass-through families out (pure);
- :mod:`.httpget` and :mod:`.scrape`: an engine's metrics endpoint, over one keep-alive connection
  with a deadline below the sampling interval;
- :mod:`.mpfiles`: prometheus_client's multiprocess ``*.db`` files, found from a PID, read
  read-only and torn-read safe;
- :mod:`.decodelog`: SGLang's decode log line, followed in a file;
- :mod:`.worker`: each source runs in its own thread, so a slow one never delays a sample;
- :mod:`.target`: the agent's target kind for all of them;
- :mod:`.passthrough`: unmapped series on the agent's ``/metrics`` under the engine's names.

Nothing here imports prometheus_client at module import time: only a scrape target loads its text
parser, so a PID-only agent stays as small as before.
"""
