"""The bundle's Prometheus rule files, for the tools and tests that load them.

NODE_RULES run where a node is scraped (a single Prometheus, or each shard); RUN_RULES need every node
of a run (the same single Prometheus, or the global layer the shards remote_write to). A single
Prometheus loads RULE_FILES, both, in this order.
"""

from pathlib import Path

import yaml

RULES_DIR = Path(__file__).resolve().parent
NODE_RULES = RULES_DIR / "stepscope-node.rules.yml"
RUN_RULES = RULES_DIR / "stepscope-run.rules.yml"
RULE_FILES = (NODE_RULES, RUN_RULES)


def groups(files: tuple[Path, ...] = RULE_FILES) -> list[dict]:
    """Every rule group of `files`, in order."""
    return [group for path in files for group in yaml.safe_load(path.read_text())["groups"]]


def rules(files: tuple[Path, ...] = RULE_FILES) -> list[dict]:
    """Every rule (recording and alerting) of `files`, in order."""
    return [rule for group in groups(files) for rule in group["rules"]]
