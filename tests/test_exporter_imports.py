"""What a default exporter keeps out of its memory until a feature asks for it (issue 20: no more RSS than
nvitop-exporter, which the H100 side by side met only at parity: 54.2 and 54.4 MiB against 54.2)."""

import sys
from pathlib import Path

import bcrypt
import requests

from stepscope_testkit.ingest_bodies import full_body
from stepscope_testkit.processes import exporter_env, free_port, running, running_exporter
from tests.support.certs import make_cert


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


def ssl_loaded(pid: int) -> bool:
    """Whether the process mapped OpenSSL's libssl (with ssl's libcrypto): 4.2 MiB of RSS once imported."""
    return "/libssl." in Path(f"/proc/{pid}/maps").read_text()


def test_ssl_loads_only_where_tls_is_served(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prom: {bcrypt.hashpw(b'pw', bcrypt.gensalt(4)).decode()}\n")
    with running_exporter(tmp_path, "--collectors", "node,process", "--web.config.file", str(config)) as exporter:
        assert requests.get(f"{exporter.url}/metrics", timeout=10).status_code == 401
        assert requests.get(f"{exporter.url}/metrics", auth=("prom", "pw"), timeout=10).status_code == 200
        requests.put(f"{exporter.url}/metrics/job/stepscope/run/r/rank/0", data=full_body(),
                     timeout=10).raise_for_status()
        assert not ssl_loaded(exporter.process.pid)  # asyncio would have imported it
    cert, key = make_cert(tmp_path, "plain-or-tls")
    port = free_port()
    with running(
        [sys.executable, "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}", "--collectors", "",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key)],
        f"https://127.0.0.1:{port}/-/ready", tmp_path / "tls.log", env=exporter_env(), verify=str(cert),
    ) as exporter:
        assert requests.get(f"https://127.0.0.1:{port}/metrics", verify=str(cert), timeout=10).ok
        assert ssl_loaded(exporter.process.pid)
