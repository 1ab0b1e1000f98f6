"""How close does ``scirl eval`` come to the concurrency bound against a server with fixed latency?

A local OpenAI-compatible server (another process) answers every request after
``--latency`` seconds (an asyncio sleep, so it never blocks). The eval client
runs over ``--questions`` synthetic questions at ``--concurrency`` requests in
flight, writing its records file as the real command does. No client can beat
concurrency / latency requests per second; the goal is >= 0.9 of that.

    python benchmarks/bench_eval.py [--questions 800] [--concurrency 32] [--latency 0.5] [--bare]

Install the ``bench`` extra first (httptools, uvloop): with uvicorn's pure-Python
HTTP parser the test server itself, not the client, is the bottleneck on a small
machine. ``--bare`` also times a client that does nothing but post, to tell the
client's cost from the machine's load.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path


def run_server(latency: float, port_queue) -> None:
    """A lean Starlette app (no request validation): the client, not the server, is what is measured."""
    import asyncio
    import json

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from scirl.serve import bind_socket

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fixed-latency", "object": "model"}]})

    async def chat(request):
        body = json.loads(await request.body())
        await asyncio.sleep(latency)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": "Answer: A"}, "finish_reason": "stop"}
            for i in range(body.get("n", 1))
        ]
        return JSONResponse(
            {
                "id": "bench",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            }
        )

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    sock = bind_socket("127.0.0.1", 0)
    port_queue.put(sock.getsockname()[1])
    uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=4096)).run(sockets=[sock])


async def bare_client(url: str, n_requests: int, concurrency: int) -> float:
    """The floor to compare with: workers that only post and parse JSON (no prompts, retries, scoring, records)."""
    import asyncio

    import httpx

    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        todo.put_nowait(i)
    payload = {"model": "fixed-latency", "messages": [{"role": "user", "content": "hi"}]}
    ssl_context = httpx.create_ssl_context()

    async def worker():
        async with httpx.AsyncClient(timeout=30, verify=ssl_context) as http:
            while not todo.empty():
                todo.get_nowait()
                (await http.post(url + "/chat/completions", json=payload)).json()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--latency", type=float, default=0.5, help="server latency per request, seconds")
    p.add_argument("--n-samples", type=int, default=1)
    p.add_argument(
        "--bare", action="store_true", help="also time a bare HTTP client, to tell client cost from machine load"
    )
    args = p.parse_args()

    from scirl.eval.client import ClientConfig, evaluate_server
    from scirl.synth.questions import generate_rows
    from scirl.task.data import question_from_row

    per_domain = -(-args.questions // 4)
    rows = generate_rows(n_per_domain=per_domain, seed=0, non_mcq=False)
    questions = [question_from_row(r, source=f"bench:{i}") for i, r in enumerate(rows)][: args.questions]

    ports = mp.Queue()
    server = mp.Process(target=run_server, args=(args.latency, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        cfg = ClientConfig(
            base_url=f"http://127.0.0.1:{port}/v1",
            model="fixed-latency",
            n_samples=args.n_samples,
            concurrency=args.concurrency,
            timeout=30,
        )
        evaluate_server(questions[:4], cfg, progress=False)  # wait until the server answers (not timed)
        with tempfile.TemporaryDirectory() as tmp:
            start, cpu_start = time.perf_counter(), time.process_time()
            results = evaluate_server(questions, cfg, out=Path(tmp) / "bench.json", progress=False)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if args.bare:
            import asyncio

            bare = asyncio.run(bare_client(cfg.base_url, len(questions), args.concurrency))
    finally:
        server.terminate()
        server.join(timeout=10)

    assert results["counts"]["answered"] == len(questions), results["counts"]
    rate = len(questions) / elapsed
    bound = args.concurrency / args.latency
    import importlib.util

    fast = all(importlib.util.find_spec(m) for m in ("httptools", "uvloop"))
    print(
        f"questions {len(questions)}  concurrency {args.concurrency}  latency {args.latency:g} s  n_samples "
        f"{args.n_samples}  server {'httptools+uvloop' if fast else 'h11+asyncio (install the bench extra)'}"
    )
    print(f"elapsed {elapsed:.2f} s  (ideal {len(questions) / bound:.2f} s)")
    print(
        f"client CPU {cpu:.2f} s = {1000 * cpu / len(questions):.2f} ms per question (load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    print(f"requests/s {rate:.1f}  bound {bound:.1f}  ratio {rate / bound:.3f}  (goal >= 0.9)")
    if args.bare:
        print(
            f"bare HTTP client on this machine now: requests/s {len(questions) / bare:.1f}  ratio "
            f"{len(questions) / bare / bound:.3f}"
        )


if __name__ == "__main__":
    main()
