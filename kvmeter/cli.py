"""``kvmeter`` — the one console script.

Each sub-command lives in the package that owns it and is imported only when used (importing vLLM
or Streamlit for ``kvmeter billing`` would cost seconds). A command module defines::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...     # the process exit status
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

__all__ = ["main", "COMMANDS"]

#: name → (module, one-line help). Order is the order ``kvmeter --help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvmeter.serving.serve_cmd", "run the OpenAI-compatible gateway in front of an engine"),
    "replay": ("kvmeter.serving.replay.cli", "replay a real request trace against a running gateway"),
    "demo": ("kvmeter.serving.demo", "serve on the embedded defaults, replay a real trace, print results"),
    "model": ("kvmeter.model", "prepare the bundled SmolLM2-135M model (dequantize the GGUF once)"),
    "simulate": ("kvmeter.serving.engines.sim.cli", "simulate a GPU vLLM replica under a trace and a policy"),
    "billing": ("kvmeter.ledger.cli", "billing reports and three-way reconciliation from the ledger"),
    "dashboard": ("kvmeter.dashboards.cli", "start the Streamlit dashboards"),
    "gpu": ("kvmeter.collectors.gpu_cli", "read GPU signals through NVML (or a capture) once"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # the docstring's first line without its reST markup: "kvmeter — the one console script."
    parser = argparse.ArgumentParser(prog="kvmeter", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in COMMANDS), None)  # skips global options' values
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
