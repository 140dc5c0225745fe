"""What a default exporter keeps out of its memory until a feature asks for it (issue 20: no more RSS than
nvitop-exporter, which the H100 side by side met only at parity: 54.2 and 54.4 MiB against 54.2)."""

from pathlib import Path

import requests

from stepscope_testkit.ingest_bodies import full_body
from stepscope_testkit.processes import running_exporter


def hashlib_loaded(pid: int) -> bool:
    """Whether the process mapped OpenSSL's digests (_hashlib): 0.74 MiB of RSS once imported."""
    return "/_hashlib." in Path(f"/proc/{pid}/maps").read_text()


def test_hashlib_loads_only_when_a_token_password_or_trace_needs_it(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors", "node,process") as exporter:
        requests.put(f"{exporter.url}/metrics/job/stepscope/run/r/rank/0", data=full_body(),
                     timeout=10).raise_for_status()
        requests.get(f"{exporter.url}/metrics", timeout=10).raise_for_status()
        assert not hashlib_loaded(exporter.process.pid)  # pushes and scrapes without a token: never
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with running_exporter(tmp_path, "--collectors", "", "--ingest-token-file", str(token)) as exporter:
        assert not hashlib_loaded(exporter.process.pid)
        requests.put(f"{exporter.url}/metrics/job/stepscope/run/r/rank/0", data=full_body(), timeout=10,
                     headers={"Authorization": "Bearer s3cret"}).raise_for_status()
        assert hashlib_loaded(exporter.process.pid)  # the token's constant-time comparison needs it
