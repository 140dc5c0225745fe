"""Push API for training hooks (Pushgateway subset). Placeholder until the hooks issue lands."""

import argparse

from exporter.exposition import ExpositionStore


class PushApi:
    max_body_bytes = 0

    def registered_processes(self) -> dict[int, dict[str, str]]:
        return {}

    def start(self) -> None: ...

    def stop(self) -> None: ...


def add_flags(group: argparse._ArgumentGroup) -> None:
    """Ingest flags are added by the hooks issue."""


def build(args: argparse.Namespace, store: ExpositionStore) -> PushApi | None:
    return None
