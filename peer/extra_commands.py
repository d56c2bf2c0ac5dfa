"""Subcommands that belong to later capabilities (export, ...) register here, keeping cli.py small."""


def register(sub) -> None:
    return None
