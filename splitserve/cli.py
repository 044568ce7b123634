"""splitserve command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _bench(args) -> int:
    if args.bench_cmd == "engine":
        from splitserve.bench import engine
        engine.run(args)
    return 0


def _chat(args) -> int:
    from splitserve import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    out = llm.chat([{"role": "user", "content": args.message}], params)[0]
    print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="cmd", required=True)

    chat = sub.add_parser("chat", help="answer one chat message offline")
    chat.add_argument("message")
    chat.add_argument("--model", default=None)
    chat.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.set_defaults(func=_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_cmd", required=True)
    from splitserve.bench import engine
    engine.add_arguments(bench_sub.add_parser("engine", help="engine prefill/decode tok/s"))
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
