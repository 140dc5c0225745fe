"""A real Debian `prometheus-pushgateway` on a loopback port, for the training-hooks tests."""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stepscope_testkit.processes import Running, free_port, running

PUSHGATEWAY = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"


@contextmanager
def running_pushgateway(tmp_path: Path, port: int | None = None) -> Iterator[Running]:
    """A fresh Pushgateway (no persistence: a restart forgets every group) until the block ends."""
    port = port or free_port()
    # Debian's build persists to /var/lib/prometheus/pushgateway.data by default: shared, and it would
    # survive a restart. An empty file name keeps everything in memory.
    argv = [PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file="]
    log_path = tmp_path / f"pushgateway-{port}-{len(list(tmp_path.glob('pushgateway-*.log')))}.log"
    with running(argv, f"http://127.0.0.1:{port}/-/ready", log_path,
                 base_url=f"http://127.0.0.1:{port}") as proc:
        yield proc
