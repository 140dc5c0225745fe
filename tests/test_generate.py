"""One command writes every generated file, and the committed files are exactly its output."""

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grafana import __main__ as cli
from grafana import generate
from stepscope.contract import THRESHOLDS
from tests.support.helm_chart import objects, render

REPO = generate.REPO
ALERTS_PAGE = Path("docs/alerts.md")  # its alert table is generated


def test_committed_outputs_are_what_generate_writes() -> None:
    """Regenerate and diff, for every output: a source edited without `python -m grafana generate` fails."""
    assert generate.stale() == [], "generated files are out of date: run python -m grafana generate"


def test_check_command_passes_on_the_repository() -> None:
    result = subprocess.run([sys.executable, "-m", "grafana", "generate", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The generated files and their non-Python sources, copied with the chart's link kept a link."""
    root = tmp_path / "repo"
    for part in ("grafana/rules/src", "grafana/rules_out", "grafana/docs", "grafana/provisioning",
                 "grafana/dashboards_out", "grafana/alerting_out", "helm/stepscope", "docker/alertmanager/templates"):
        shutil.copytree(REPO / part, root / part, symlinks=True)
    (root / "docs").mkdir()
    shutil.copy(REPO / generate.METRICS_DOC, root / generate.METRICS_DOC)
    shutil.copy(REPO / ALERTS_PAGE, root / ALERTS_PAGE)
    assert generate.stale(root) == []
    return root


def test_generate_mends_hand_edits_stale_files_and_the_chart_links(checkout: Path) -> None:
    (checkout / generate.DASHBOARDS_OUT / "stepscope-node.json").write_text("{}\n")
    (checkout / generate.DASHBOARDS_OUT / "stepscope-old.json").write_text("{}\n")
    readme = checkout / generate.METRICS_DOC
    readme.write_text(readme.read_text().replace("| `stepscope_node_cpus` |", "| `stepscope_node_cores` |"))
    (checkout / generate.RULES_OUT / "stepscope-node.rules.yml").unlink()
    (checkout / generate.RULES_OUT / "stepscope-old.rules.yml").write_text("groups: []\n")
    (checkout / generate.CHART_DASHBOARDS).unlink()
    (checkout / generate.CHART_RULES).unlink()
    (checkout / generate.CHART_RULES).symlink_to("../../../grafana/rules", target_is_directory=True)
    assert generate.stale(checkout) == [
        "differs: grafana/dashboards_out/stepscope-node.json",
        "missing: grafana/rules_out/stepscope-node.rules.yml",
        "differs: docs/exporter.md",
        "stale: grafana/dashboards_out/stepscope-old.json (no source builds it)",
        "stale: grafana/rules_out/stepscope-old.rules.yml (no source builds it)",
        "not a link to ../../../grafana/dashboards_out: helm/stepscope/files/dashboards",
        "not a link to ../../../grafana/rules_out: helm/stepscope/files/rules",
    ]
    changed = generate.write(checkout)
    assert set(map(str, changed)) == {
        "grafana/dashboards_out/stepscope-node.json", "grafana/dashboards_out/stepscope-old.json",
        "grafana/rules_out/stepscope-node.rules.yml", "grafana/rules_out/stepscope-old.rules.yml",
        "docs/exporter.md", "helm/stepscope/files/dashboards", "helm/stepscope/files/rules",
    }
    assert generate.stale(checkout) == [] and generate.write(checkout) == []
    assert readme.read_text() == (REPO / generate.METRICS_DOC).read_text()
    dashboards = [o for o in objects(render(checkout / "helm" / "stepscope")) if o["kind"] == "ConfigMap"]
    assert {name for o in dashboards for name in o["data"]} == set(generate.dashboards.BUILDERS)
    rules = render(checkout / "helm" / "stepscope", api_versions=["monitoring.coreos.com/v1"])
    assert "StepscopeStragglerRank" in "".join(rules.values())


def alert_row(page: Path, alert: str) -> str:
    (row,) = [line for line in page.read_text().splitlines() if line.startswith(f'| <a id="{alert.lower()}"></a>')]
    return row


def test_a_threshold_or_for_changed_at_its_source_reaches_the_alert_table(checkout: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The table spelled "`dataloader_next` > 30% of step time for 10m" by hand: a contract threshold or a rule's
    `for` changed and regenerated left the page telling users the old number, with `generate --check` clean."""
    monkeypatch.setitem(THRESHOLDS, "data_loading_share", dataclasses.replace(THRESHOLDS["data_loading_share"],
                                                                               value=0.25))
    source = checkout / generate.RULES_SRC / "stepscope-node.rules.yml"
    text = source.read_text()
    alert = text.index("- alert: StepscopeDataLoadingBottleneck")
    source.write_text(text[:alert] + text[alert:].replace("for: 10m", "for: 20m", 1))
    assert "differs: docs/alerts.md" in generate.stale(checkout)
    generate.write(checkout)
    assert "`dataloader_next` > 25% of step time for 20m |" in alert_row(checkout / ALERTS_PAGE,
                                                                          "StepscopeDataLoadingBottleneck")


def test_an_alert_without_a_row_in_the_alert_table_is_a_one_line_error(checkout: Path) -> None:
    source = checkout / generate.ALERT_TABLE_SRC
    source.write_text("".join(line for line in source.read_text().splitlines(keepends=True)
                              if "`StepscopeCpuSaturated`" not in line))
    with pytest.raises(generate.GenerateError, match=r"^grafana/docs/alert-table.md: no row for the alert\(s\) "
                                                     r"StepscopeCpuSaturated$"):
        generate.stale(checkout)


def test_an_unknown_placeholder_is_a_one_line_error(checkout: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    source = checkout / generate.RULES_SRC / "stepscope-run.rules.yml"
    source.write_text(source.read_text() + "# <<family:NO_SUCH_FAMILY>>\n")
    monkeypatch.setattr(generate, "REPO", checkout)
    for args in (["generate"], ["generate", "--check"]):
        assert cli.main(args) == 2
        out, err = capsys.readouterr()
        line = len(source.read_text().splitlines())
        assert (out, err.count("\n")) == ("", 1)
        assert err.startswith(f"generate: error: grafana/rules/src/stepscope-run.rules.yml:{line}: unknown "
                              "placeholder <<family:NO_SUCH_FAMILY>>"), err


def test_check_lists_what_is_stale_and_exits_1(checkout: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (checkout / generate.ALERTS_OUT).write_text("groups: []\n")
    monkeypatch.setattr(generate, "REPO", checkout)
    assert cli.main(["generate", "--check"]) == 1
    out, err = capsys.readouterr()
    assert out == "differs: grafana/alerting_out/stepscope-alerts.yml\n"
    assert err == "generated files are out of date: run python -m grafana generate\n"
    assert cli.main(["generate"]) == 0
    assert capsys.readouterr().out == "grafana/alerting_out/stepscope-alerts.yml\n"
    assert cli.main(["generate", "--check"]) == 0


def test_a_directory_where_the_chart_link_belongs_is_refused(checkout: Path) -> None:
    link = checkout / generate.CHART_DASHBOARDS
    link.unlink()
    link.mkdir()
    with pytest.raises(generate.GenerateError, match="dashboards is a directory: remove it"):
        generate.write(checkout)
