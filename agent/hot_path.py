"""Names the storm path's modules that the image compiles with mypyc, and tells whether this process runs them so.

A storm of distinct Xid lines goes through these modules once a line; compiled, they cost about half the CPU
(scripts/bench_engine.py). Everything else stays interpreted. `scripts/compile-hot-path` compiles exactly
this list; a development checkout runs them as plain Python, with the same behaviour (the test suite runs
on both builds).
"""

from __future__ import annotations

import importlib
import importlib.machinery

#: The storm path, kernel-log line to verdict: parser (and its Xid fields), source, deduplication, attribution, engine.
COMPILED_MODULES = (
    "agent.sources.kernel_log",
    "agent.sources.xid_fields",
    "agent.sources.kmsg",
    "agent.sources.kmsg_records",
    "agent.sources.dedup",
    "agent.sources.attribution",
    "agent.workloads",
    "agent.engine.evaluate",
    "agent.engine.state",
    "agent.engine.index",
)

#: The shared library mypyc builds for the group (it holds the compiled code the modules' shims load).
GROUP_NAME = "agent.hot_path_native"


def compiled_modules() -> tuple[str, ...]:
    """Those of COMPILED_MODULES that this process loaded from a compiled extension, not from source."""
    compiled = []
    for name in COMPILED_MODULES:
        origin = getattr(importlib.import_module(name), "__file__", None) or ""
        if origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            compiled.append(name)
    return tuple(compiled)


def describe() -> str:
    """One line for `--version` and the start-up log: how much of the storm path is compiled."""
    done = compiled_modules()
    if not done:
        return "storm path interpreted"
    return f"storm path compiled with mypyc: {len(done)} of {len(COMPILED_MODULES)} modules"
