"""What torch.compile did in this process, from dynamo's own counters (``torch._dynamo.utils.counters``): the graphs
it compiled, the graph breaks it met, and the times a code object hit the recompile limit (after which dynamo runs
it eagerly: for flex attention, the unfused path that materialises the whole score matrix). Counters only grow
(``torch._dynamo.reset`` clears the caches, not them), so a stretch of work is measured as the difference of two
readings."""

from __future__ import annotations


def compile_counts() -> dict[str, int]:
    """The counts so far: ``graphs`` (each graph dynamo handed to its backend: a first compile or a recompile),
    ``graph_breaks`` and ``recompile_limit_hits``."""
    from torch._dynamo.utils import counters

    # the limit is reported as an unsupported construct whose text names it ("Dynamo recompile limit exceeded" in
    # torch 2.13, "Dynamo cache limit exceeded" before; both explain "attempted to recompile ... too many times")
    limit_hits = sum(
        n for text, n in counters["unimplemented"].items() if "recompile" in text.lower() and "limit" in text.lower()
    )
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompile_limit_hits": limit_hits,
    }


def counts_since(before: dict[str, int]) -> dict[str, int]:
    now = compile_counts()
    return {key: now[key] - before[key] for key in now}
