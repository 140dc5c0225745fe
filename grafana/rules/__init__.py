"""The bundle's Prometheus rule files, for the tools and tests that load them.

Sources (grafana/rules/src/*.rules.yml) spell contract names as placeholders (grafana/rules/render.py);
`python -m grafana generate` writes the rule files Prometheus loads to grafana/rules_out/. Everything
that loads rules reads the outputs. NODE_RULES run where a node is scraped (a single Prometheus, or
each shard); RUN_RULES need every node of a run (the same single Prometheus, or the global layer the
shards remote_write to). A single Prometheus loads RULE_FILES, both, in this order.
"""

from pathlib import Path

import yaml

RULES_DIR = Path(__file__).resolve().parent
SOURCES_DIR = RULES_DIR / "src"
OUT_DIR = RULES_DIR.parent / "rules_out"
NODE_RULES = OUT_DIR / "stepscope-node.rules.yml"
RUN_RULES = OUT_DIR / "stepscope-run.rules.yml"
RULE_FILES = (NODE_RULES, RUN_RULES)


def groups(files: tuple[Path, ...] = RULE_FILES) -> list[dict]:
    """Every rule group of `files`, in order."""
    return [group for path in files for group in yaml.safe_load(path.read_text())["groups"]]


def rules(files: tuple[Path, ...] = RULE_FILES) -> list[dict]:
    """Every rule (recording and alerting) of `files`, in order."""
    return [rule for group in groups(files) for rule in group["rules"]]
