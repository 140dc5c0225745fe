"""The sharded layout's example configs (docker/prometheus/sharded/) as tests and benchmarks read them."""

import hashlib
from pathlib import Path

import yaml

SHARDED_DIR = Path(__file__).resolve().parents[1] / "docker" / "prometheus" / "sharded"


def shard_write_filter() -> tuple[str, str]:
    """(keep, drop) metric-name regexes of the shards' remote_write, what the global layer gets; drop
    is "" (matches no name) when the config keeps everything `keep` matches."""
    (write,) = yaml.safe_load((SHARDED_DIR / "shard.yml").read_text())["remote_write"]
    actions = {relabel["action"]: relabel["regex"] for relabel in write["write_relabel_configs"]}
    return actions["keep"], actions.get("drop", "")


def hashmod(value: str, modulus: int) -> int:
    """Prometheus' hashmod relabelling: the last 8 bytes of the MD5 of the value, big-endian, mod n."""
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus
