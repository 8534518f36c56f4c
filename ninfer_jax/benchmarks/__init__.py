"""Reusable benchmark code: the report writer, the agentic trace, the real-model shapes and random engines,
and the profiler-trace readers. The command lines live in `scripts/`; their pages in `docs/benchmarks/`."""
