"""`pdserve` command line.

Subcommands: `serve SPEC` (start the spec's pools on Ray behind the OpenAI-compatible HTTP API, see
`cluster/launch.py`); `scale URL --pool P --replicas N` (resize a serving cluster's pool: the admin
endpoint, with the API key from `--api-key-env`, default PDSERVE_API_KEY, when set); `generate PROMPT` (one engine in this process, or with `--spec` through a cluster;
prints text, TTFT, tok/s); `validate SPEC` (reads a cluster spec, resolves its model and checks the spec
against it -- a Hub id only from the cache, never downloading, `cluster/spec_model.py`; with `--ray-address`
also that the running Ray's nodes can hold each pool; prints "ok: <summary>" or each problem as
`SPEC: <dotted.key>: <reason>` on stderr, exit 2).
The bench and the planner own their subcommands (`bench`, `plan`, `profile`): each subpackage's `cli`
module has `register(subparsers)`, which must stay cheap (heavy imports happen inside the handlers).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

SUBCOMMAND_MODULES = ("cluster.bench.cli", "cluster.planner.cli")


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, PdserveError, SamplingParams

    if args.spec:
        from cluster.launch import generate_on_spec

        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        return generate_on_spec(args.spec, args.prompt, params, chat=args.chat, address=args.address)

    try:
        llm = LLM(model=args.model, revision=args.revision, dtype=args.dtype, num_threads=args.threads)
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        start = time.perf_counter()
        rid = llm.add_request(prompt, params)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first = None
    final = None
    while final is None:
        for out in llm.step():
            if out.request_id != rid:
                continue
            if first is None and out.token_ids:
                first = time.perf_counter()
            if args.stream:
                print(llm.tokenizer.decode(out.new_token_ids), end="", flush=True)
            if out.finished:
                final = out
    end = time.perf_counter()
    if args.stream:
        print()
    else:
        print(final.text)
    n = len(final.token_ids)
    decode_rate = (n - 1) / (end - first) if n > 1 and end > first else float("nan")
    print(f"\n--- {n} tokens, finish={final.finish_reason}, time to first token {1000 * (first - start):.0f} ms, "
          f"{decode_rate:.1f} tokens/s (decode), {n / (end - start):.1f} tokens/s overall", file=sys.stderr)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from cluster.serving_api import BackendUnavailableError
    from cluster.spec import SpecError, load_spec
    from cluster.spec_model import config_for_validate

    note = ""
    try:
        spec = load_spec(args.spec)
        if not args.skip_model:
            config, note = config_for_validate(spec)  # never downloads: a Hub id reads the cache only
            if config is not None:
                spec.check_against_model(config)
        if args.ray_address:  # (joins that Ray: the launcher's job, like serving)
            from cluster.launch import placement_problems

            unplaceable = placement_problems(spec, args.ray_address)
            if unplaceable:
                raise SpecError(unplaceable)
    except SpecError as e:
        for problem in e.problems:
            print(f"{args.spec}: {problem}", file=sys.stderr)
        return 2
    except (BackendUnavailableError, ConnectionError) as e:  # --ray-address: that Ray refused us, or is not there
        print(f"{args.spec}: --ray-address {args.ray_address}: {e}", file=sys.stderr)
        return 2
    print(f"ok: {spec.summary()}" + (" (model not checked)" if args.skip_model else ""))
    if note:
        print(f"note: {note}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    import os

    from cluster.client import Client, PdserveClientError

    key = os.environ.get(args.api_key_env) or None
    try:
        with Client(args.url, api_key=key, timeout=args.timeout) as client:
            out = client.scale(args.pool, args.replicas)
    except PdserveClientError as e:
        print(f"pdserve scale: {e}", file=sys.stderr)
        return 2
    added, removed = ", ".join(out["added"]) or "none", ", ".join(out["removed"]) or "none"
    print(f"ok: pool {out['pool']} has {out['replicas']} replica(s) (added: {added}; removed: {removed})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from cluster.launch import serve

    return serve(args.spec, args.address, args.port, args.self_test)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with one in-process engine")
    g.add_argument("prompt")
    g.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m, a Hugging Face Hub id (org/name), a model directory or a .gguf file")
    g.add_argument("--revision", help="with a Hub id: branch, tag or commit (default main)")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--threads", type=int, default=1, help="torch threads (one per worker process is best)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--spec", help="run through the cluster of this YAML spec instead of one engine")
    g.add_argument("--address", help="with --spec: Ray address to join (auto, host:port)")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="serve a cluster spec behind the OpenAI-compatible HTTP API")
    s.add_argument("spec", help="path to the YAML cluster spec, e.g. deploy/local.yaml")
    s.add_argument("--address", help="Ray address to join (auto, host:port, ray://...); default: the spec's")
    s.add_argument("--port", type=int, help="HTTP port; default: the spec's (8000)")
    s.add_argument("--self-test", metavar="PROMPT", help="answer one completion over HTTP, print it, exit")
    s.set_defaults(func=_serve)
    c = sub.add_parser("scale", help="resize a pool of a serving cluster (adds or drains replicas)")
    c.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    c.add_argument("--pool", required=True, help="prefill, decode or colocated")
    c.add_argument("--replicas", type=int, required=True, help="the pool's size from now on (>= 1)")
    c.add_argument("--api-key-env", default="PDSERVE_API_KEY", help="environment variable with the API key")
    c.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the resize to finish")
    c.set_defaults(func=_scale)
    v = sub.add_parser("validate", help="check a cluster spec (YAML) and the model it names")
    v.add_argument("spec", help="path to the YAML cluster spec, e.g. deploy/local.yaml")
    v.add_argument("--skip-model", action="store_true",
                   help="check the file alone: do not resolve the model (no heads/layers checks)")
    v.add_argument("--ray-address", metavar="ADDRESS",
                   help="also check that the nodes of the running Ray at ADDRESS (auto, HOST:PORT, ray://...) "
                        "can hold each pool (accelerator_type, custom resources, GPUs); default: offline")
    v.set_defaults(func=_validate)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
