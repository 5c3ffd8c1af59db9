"""``llmsession serve``'s arguments on who may call it: the tenants' and operators' keys (on the
command line, or read from files, which other users of the machine cannot read in ``ps``), the
web origins whose pages may, and the host names a loopback-bound server answers to. Pure."""

from __future__ import annotations

import argparse

from llmsession.commands.argtypes import api_key, key_file


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--api-key",
        action="append",
        type=api_key,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` (repeatable: each key is a tenant of its own)",
    )
    add(
        "--api-key-file",
        action="append",
        type=key_file,
        metavar="PATH",
        help="--api-key for each line of PATH (`#` comments): a key on the command line is seen by "
        "every user of the machine",
    )
    add(
        "--operator-key",
        action="append",
        type=api_key,
        metavar="KEY",
        help="only these keys may load and unload models, read /api/ps and /metrics and set keep_alive "
        "(repeatable; default: any caller may; without --api-key the chat endpoints stay open)",
    )
    add(
        "--operator-key-file",
        action="append",
        type=key_file,
        metavar="PATH",
        help="--operator-key for each line of PATH",
    )
    add(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="a web origin whose pages may call the API (repeatable; default: none)",
    )
    add(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a host name requests may name this server by when it is bound to a loopback address "
        "or has no --api-key (repeatable; default: localhost and IP addresses; against DNS rebinding)",
    )


def join_key_files(args: argparse.Namespace) -> None:
    """The keys of ``--api-key-file`` and ``--operator-key-file`` joined to ``--api-key``'s and
    ``--operator-key``'s (None where there are none)."""
    for option in ("api_key", "operator_key"):
        files = getattr(args, f"{option}_file", None) or []
        keys = [*(getattr(args, option) or []), *(key for keys in files for key in keys)]
        setattr(args, option, keys or None)
