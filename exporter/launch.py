"""The exporter's console scripts, which check for the `exporter` extra before importing the server.

`pip install stepscope` brings only what the training hooks need; the daemon's server libraries come
with `pip install 'stepscope[exporter]'`. Without them, `stepscope-exporter` should say that in one
line and exit 2, not end in an ImportError traceback from deep inside the server.
"""

import importlib.util
import sys

EXTRA_MODULES = {"h11": "h11", "bcrypt": "bcrypt", "yaml": "pyyaml", "pynvml": "nvidia-ml-py",
                 "grpc": "grpcio"}


def missing_extra() -> list[str]:
    """The distributions of the `exporter` extra whose modules cannot be imported here."""
    return [dist for module, dist in EXTRA_MODULES.items() if importlib.util.find_spec(module) is None]


def _require_extra(command: str) -> None:
    missing = missing_extra()
    if missing:
        sys.stderr.write(f"{command}: needs the exporter extra (missing {', '.join(missing)}): "
                         "pip install 'stepscope[exporter]'\n")
        sys.exit(2)


def main() -> int:
    """`stepscope-exporter` and `python -m stepscope.exporter`."""
    _require_extra("stepscope-exporter")
    from stepscope.exporter.malloc_arenas import cap_malloc_arenas

    cap_malloc_arenas()  # before any thread starts
    from stepscope.exporter.cli import main as exporter_main
    return exporter_main()

