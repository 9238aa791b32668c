"""Serve a cluster spec: start the pools on Ray, put the OpenAI-compatible HTTP frontend in front.

    pdserve serve deploy/local.yaml [--address auto] [--port 8000]
    python -m cluster.launch deploy/local.yaml                      # what `ray job submit` runs
    python -m cluster.launch deploy/local.yaml --self-test "Hello"  # serve, answer one request, exit

Order: load + validate the spec -> read secrets (env/file) -> `cluster.serving.ray_pools.start_cluster` starts or joins
Ray and the workers -> uvicorn serves on the spec's host/port on this process's event loop -> on exit
(Ctrl-C, SIGTERM, end of the self-test) the router shuts down its actors and the Ray it started. Under
`ray job submit` (RAY_ADDRESS set) a spec saying `ray.address: local` joins the job's cluster instead.
`placement_problems(spec, address)` is what `pdserve validate --ray-address` asks of a running Ray: can
its nodes hold each pool (cluster/serving/placement.py)?
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from cluster.spec import Problem, SpecError, load_spec


def read_secret(source, key: str) -> str | None:
    """The secret a `{env: NAME}` / `{file: PATH}` source names; SpecError if it is missing or empty."""
    if source is None:
        return None
    if source.env is not None:
        value = os.environ.get(source.env, "")
    else:
        path = Path(source.file).expanduser()
        value = path.read_text().strip() if path.is_file() else ""
    if not value:
        raise SpecError([Problem(key, f"{source.describe()} is unset or empty")])
    return value


def _effective_spec(path: str, address: str | None, port: int | None):
    spec = load_spec(path)
    updates = {}
    if address is None and spec.ray.address == "local" and os.environ.get("RAY_ADDRESS"):
        address = "auto"  # running as a Ray job: join the job's cluster
    if address is not None:
        updates["ray"] = spec.ray.model_copy(update={"address": address})
    if port is not None:
        updates["server"] = spec.server.model_copy(update={"port": port})
    return spec.model_copy(update=updates) if updates else spec


async def _serve(router, spec, api_key: str | None, self_test: str | None) -> None:
    import uvicorn

    from cluster.server import _config

    s = spec.server
    server = uvicorn.Server(_config(router, s.host, s.port, api_key, 1 << 20, "info"))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    url = f"http://{s.host}:{s.port}/v1"
    print(f"pdserve: serving {router.model_name} ({spec.mode}) at {url}", flush=True)
    try:
        if self_test is not None and not task.done():
            await asyncio.to_thread(_self_test, url, api_key, router.model_name, self_test)
            server.should_exit = True
        await task
    finally:
        await router.shutdown()


def _self_test(url: str, api_key: str | None, model: str, prompt: str) -> None:
    from cluster.client import Client

    t0 = time.perf_counter()
    with Client(url.removesuffix("/v1"), api_key=api_key) as client:
        out = client.complete(prompt, model=model, max_tokens=24, temperature=0.0)
    print(f"pdserve self-test: {out.text!r} ({time.perf_counter() - t0:.2f} s)", flush=True)


def placement_problems(spec, address: str) -> list[Problem]:
    """`pdserve validate --ray-address`: join the running Ray at `address` and name each pool none of its
    alive nodes can hold (its accelerator type, a custom resource, GPUs or room missing) -- a look at the
    nodes now, without placing anything or waiting for an autoscaler."""
    from cluster.ray_session import init_ray, shutdown_ray
    from cluster.serving.placement import alive_nodes, shortfall

    joined = init_ray(address)
    try:
        nodes = alive_nodes()
    finally:
        if joined:
            shutdown_ray()
    short = (shortfall(name, pool, nodes) for name, pool in spec.pools_in_use().items())
    return [Problem(*s) for s in short if s is not None]


def _start(spec, path: str):
    """`start_cluster(spec)`, or None when Ray cannot place a pool (the error, naming the key, printed)."""
    from cluster.serving.placement import PlacementError
    from cluster.serving.ray_pools import start_cluster

    try:
        return start_cluster(spec)
    except PlacementError as e:
        print(f"{path}: cannot place the pools on this Ray cluster:\n  {e}", file=sys.stderr)
        return None


def serve(path: str, address: str | None = None, port: int | None = None, self_test: str | None = None) -> int:
    try:
        spec = _effective_spec(path, address, port)
        api_key = read_secret(spec.server.api_key, "server.api_key")
    except SpecError as e:
        print(f"{path}: invalid spec:\n{e}", file=sys.stderr)
        return 2
    router = _start(spec, path)
    if router is None:
        return 1
    try:
        asyncio.run(_serve(router, spec, api_key, self_test))
    except KeyboardInterrupt:
        pass
    return 0


def generate_on_spec(path: str, prompt: str, params, chat: bool = False, address: str | None = None) -> int:
    """`pdserve generate --spec`: one request through the spec's cluster, printing text, TTFT and tok/s."""
    from cluster.serving_api import GenerateRequest

    try:
        spec = _effective_spec(path, address, None)
    except SpecError as e:
        print(f"{path}: invalid spec:\n{e}", file=sys.stderr)
        return 2
    router = _start(spec, path)
    if router is None:
        return 1

    async def run() -> None:
        try:
            ids = router.tokenizer().apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            t0, first, n = time.perf_counter(), None, 0
            async for d in router.generate(GenerateRequest("cli-0", ids, params, router.model_name)):
                first = first or (time.perf_counter() if d.new_token_ids else None)
                n = d.completion_tokens
                print(d.new_text, end="", flush=True)
            end = time.perf_counter()
            rate = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
            print(f"\n--- {n} tokens via {spec.mode} cluster, time to first token "
                  f"{1000 * ((first or end) - t0):.0f} ms, {rate:.1f} tokens/s (decode)", file=sys.stderr)
        finally:
            await router.shutdown()

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.launch", description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--address", help="Ray address to join (auto, host:port, ray://...); default from the spec")
    p.add_argument("--port", type=int, help="HTTP port; default from the spec")
    p.add_argument("--self-test", metavar="PROMPT", help="answer one completion over HTTP, print it, exit")
    a = p.parse_args(argv)
    return serve(a.spec, a.address, a.port, a.self_test)


if __name__ == "__main__":
    sys.exit(main())
