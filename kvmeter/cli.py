"""``kvmeter`` — the one console script.

Each sub-command lives in the package that owns it and is imported only when used (importing vLLM
or Streamlit for ``kvmeter billing`` would cost seconds). A command module defines::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...     # the process exit status

Logging goes to stderr. The commands that print a result (``billing``, ``gpu``) log at WARNING by
default, so no library INFO line (httpx's ``HTTP Request: ...``, the ledger's ``ledger open``)
comes before their output; the others (``serve``, ``demo``, ...) at INFO. ``-v``/``--verbose``
sets INFO for any command, ``--log-level LEVEL`` any level (it wins over ``-v``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

__all__ = ["main", "COMMANDS", "QUIET_COMMANDS", "CHATTY_LIBRARIES", "log_level", "configure_logging"]

#: name → (module, one-line help). Order is the order ``kvmeter --help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvmeter.serving.serve_cmd", "run the OpenAI-compatible gateway in front of an engine"),
    "replay": ("kvmeter.serving.replay.cli", "replay a real request trace against a running gateway"),
    "demo": ("kvmeter.serving.demo", "serve on the embedded defaults, replay a real trace, print results"),
    "model": ("kvmeter.model", "prepare the bundled SmolLM2-135M model (dequantize the GGUF once)"),
    "simulate": ("kvmeter.serving.simulator.cli", "simulate a GPU vLLM replica under a trace and a policy"),
    "billing": ("kvmeter.ledger.cli", "billing reports and three-way reconciliation from the ledger"),
    "dashboard": ("kvmeter.dashboards.cli", "start the Streamlit dashboards"),
    "gpu": ("kvmeter.collectors.gpu_cli", "read the GPUs through NVML (or a capture) once"),
    "check": ("kvmeter.serving.selfcheck.cli", "self-checks of a running serve (its /metrics): exit 1 if one fails"),
}

#: Commands whose output is a result read by people or scripts: WARNING unless -v/--log-level.
QUIET_COMMANDS = frozenset({"billing", "gpu", "check"})

_VERBOSE_HELP = "show INFO logs, the libraries' included (e.g. httpx's request lines)"


def _level(text: str) -> str:
    """argparse type: a logging level name (any case) or number, returned upper-cased."""
    level = text.strip().upper()
    if not level.isdigit() and not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {text!r}")
    return level


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # the docstring's first line without its reST markup: "kvmeter — the one console script."
    parser = argparse.ArgumentParser(prog="kvmeter", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--log-level", type=_level, default=None, metavar="LEVEL",
                        help="logging level (default INFO; WARNING for " + ", ".join(sorted(QUIET_COMMANDS)) + ")")
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in COMMANDS), None)  # skips global options' values
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
        _accept_verbose(p)
    return parser


def _accept_verbose(parser: argparse.ArgumentParser) -> None:
    """Let ``-v`` follow the command too, at any depth (``kvmeter billing report -v``), unless a
    command defines its own ``-v``/``--verbose``. SUPPRESS: a sub-command's default must not
    overwrite a ``-v`` given before it."""
    if not {"-v", "--verbose"} & set(parser._option_string_actions):
        parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser once
                _accept_verbose(child)


def log_level(args: argparse.Namespace) -> str:
    """The logging level for parsed ``args``: ``--log-level``, else INFO with ``-v``, else WARNING
    for :data:`QUIET_COMMANDS` and INFO for the rest."""
    if args.log_level:
        return args.log_level
    return "INFO" if args.verbose or args.command not in QUIET_COMMANDS else "WARNING"


#: Libraries whose INFO lines (one per HTTP request) only ``-v``/``--log-level`` shows.
CHATTY_LIBRARIES = ("httpx", "httpcore")


def configure_logging(args: argparse.Namespace) -> None:
    """Logging to stderr at :func:`log_level`; without ``-v`` or ``--log-level`` the
    :data:`CHATTY_LIBRARIES` log at WARNING (a trace replay would print a line per request)."""
    level = log_level(args)
    level_value = int(level) if level.isdigit() else level
    logging.basicConfig(level=level_value, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level_value)  # also when a handler was installed before
    quiet = not args.verbose and not args.log_level
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    configure_logging(args)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
