"""End to end: alerts reach a person through a real Alertmanager (Debian's prometheus-alertmanager 0.25).

Two real exporters (node-a, node-b; fake NVML), training-hook processes pushing to them, a real
Prometheus loading the generated rule files (a copy with every `for` a sixtieth: minutes become
seconds, so the alerts keep their order) and the shipped prometheus.yml's external label and alert
relabelling, and a real Alertmanager with the shipped docker/alertmanager/alertmanager.yml and
templates. Only the receiver (a webhook and a Slack receiver from receivers.example.yml, both pointed
at a server this test runs) and the group timings (the same ratio, shorter) are rewritten.

Runs: `databound` (its loader holds the step; its GPU waits), `gpubound` (busy GPU, quick loader),
`stalled` (three steps, then hangs in dataloader_next; critical) on node-a, and `spread`, data-bound with rank 0 on
node-a and rank 1 on node-b. Before issue 28 one run's critical muted every warning of its node, and
every alert paged once per node and again for each symptom of one cause.
"""

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import requests
import yaml

from grafana.rules import rules
from stepscope.contract.families import TRAINING_LAST_PUSH
from stepscope_testkit.processes import REPO_ROOT
from tests.support.alerting import (
    ALERTMANAGER_DIR,
    Inbox,
    Notification,
    alertmanager_config,
    amtool,
    example_receivers,
    firing_in_prometheus,
    running_alertmanager,
    running_training_stack,
    seconds,
    start_trainer,
    webhook_server,
)
from tests.support.prometheus import query, wait_for

GRAFANA_URL = "http://grafana.example:3000"
LOST = "lost"  # a run across both nodes whose rank 1 (node-b) is killed
ALERTS_PAGE_URL = "https://github.com/stepscope/stepscope/blob/main/docs/alerts.md"
# The shipped group_wait 30s / group_interval 1m, scaled down alike for the test.
GROUP_WAIT_SECONDS = 2
GROUP_INTERVAL_SECONDS = 4
# A resolved, from Prometheus resolving the alert: it sends at that evaluation, Alertmanager tells within one
# group_interval; 4 s of slack for a busy 2-core machine. Counted from the run's close instead it also held the
# trainer's exit, the scrapes and the rule levels: 20.6 s once in a clean-clone CI run, for a 2.2 s page.
RESOLVED_BOUND_SECONDS = GROUP_INTERVAL_SECONDS + 4
# A first page: Prometheus sends at the evaluation that fires it, Alertmanager waits group_wait; 3 s slack.
PAGE_BOUND_SECONDS = 1 + GROUP_WAIT_SECONDS + 3
# After an exporter restart: the rank's retry (a push interval, 0.5 s), the shortened DataLoadingBottleneck `for`
# (10 s) in which a resolved alert would fire anew, and two group_intervals for Alertmanager to tell of it.
RESTART_WATCH_SECONDS = 10 + 2 * GROUP_INTERVAL_SECONDS
FOR_SECONDS = {rule["alert"]: seconds(rule["for"]) // 60 for rule in rules() if "for" in rule and "alert" in rule}

pytestmark = pytest.mark.timeout(180)


@dataclass
class Stack:
    prometheus: str
    alertmanager: str
    inbox: Inbox
    trainers: dict[tuple[str, int], subprocess.Popen]
    restart_exporter: Callable[[str, float], None]


@pytest.fixture(scope="module")
def webhook() -> Iterator[tuple[str, Inbox]]:
    with webhook_server() as served:
        yield served


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory, webhook: tuple[str, Inbox]) -> Iterator[str]:
    """The shipped config and templates; only the receiver and the group timings rewritten."""
    tmp = tmp_path_factory.mktemp("alertmanager")
    shipped = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    config = alertmanager_config(tmp, webhook[0], shipped, GROUP_WAIT_SECONDS, GROUP_INTERVAL_SECONDS)
    with running_alertmanager(tmp, config) as url:
        yield url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, alertmanager: str, webhook: tuple[str, Inbox]) -> Iterator[Stack]:
    """The training stack, and the run `lost` across both nodes: rank 0 trains on node-a, rank 1 is killed
    (SIGKILL) on node-b once it has pushed, so it is lost by the time the restart test runs."""
    with running_training_stack(tmp_path_factory.mktemp("alerting"), alertmanager, GRAFANA_URL) as training:
        for rank, node in enumerate(("node-a", "node-b")):  # the training stack kills them at its end
            training.trainers[(LOST, rank)] = start_trainer(LOST, rank, training.push_urls[node], 0.0, 0.05, world=2)
        assert wait_for(lambda: query(training.prometheus, f'{TRAINING_LAST_PUSH}{{run="{LOST}",rank="1"}}'), 60)
        training.trainers[(LOST, 1)].kill()
        yield Stack(training.prometheus, alertmanager, webhook[1], training.trainers, training.restart_exporter)


def alertnames(notifications: list[Notification]) -> list[str]:
    return [n.body["commonLabels"].get("alertname", "?") for n in notifications]


def test_shipped_configs_pass_amtool(tmp_path: Path) -> None:
    """The shipped config, and the shipped config with each example receiver (as the README says to
    add one), load in Alertmanager's own checker, templates included."""
    check = amtool("check-config", str(ALERTMANAGER_DIR / "alertmanager.yml"))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "1 templates" in check.stdout
    shutil.copytree(ALERTMANAGER_DIR / "templates", tmp_path / "templates")
    config = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    for example in example_receivers():  # each in place of the empty receiver of its name, else as `default`
        shipped = [r for r in config["receivers"] if r["name"] != example["name"]]
        route = config["route"] if len(shipped) < len(config["receivers"]) else \
            {**config["route"], "receiver": example["name"]}
        (tmp_path / "alertmanager.yml").write_text(
            yaml.safe_dump({**config, "receivers": [example, *shipped], "route": route}))
        check = amtool("check-config", str(tmp_path / "alertmanager.yml"))
        assert check.returncode == 0, f"{example['name']}: {check.stdout}{check.stderr}"


def test_email_template_renders_every_field(tmp_path: Path) -> None:
    """amtool renders the e-mail templates from an alert as Prometheus sends one: title, description,
    links and what to try, without Go's `<no value>`."""
    alert = {"status": "firing", "labels": {"alertname": "StepscopeDataLoadingBottleneck", "run": "r1", "rank": "0",
                                            "instance": "n1", "severity": "warning"},
             "annotations": {"summary": "Run r1 rank 0 waits for data", "description": "Rank 0 waits 75%.",
                             "runbook": "Raise num_workers.", "runbook_url": "https://runbook.example/x",
                             "dashboard_url": "https://grafana.example/d/stepscope-training?var-run=r1"}}
    data = {"receiver": "email", "status": "firing", "alerts": [alert],
            "groupLabels": {"alertname": alert["labels"]["alertname"], "run": "r1"},
            "commonLabels": alert["labels"], "commonAnnotations": alert["annotations"], "externalURL": "https://am.example"}
    (tmp_path / "data.json").write_text(json.dumps(data))
    rendered = {}
    for name in ("stepscope.email.subject", "stepscope.email.html"):
        result = amtool("template", "render", f"--template.glob={ALERTMANAGER_DIR / 'templates' / '*.tmpl'}",
                        f"--template.text={{{{ template \"{name}\" . }}}}", f"--template.data={tmp_path / 'data.json'}")
        assert result.returncode == 0, result.stderr
        rendered[name] = result.stdout
    assert rendered["stepscope.email.subject"].strip() == "[FIRING:1] Run r1 rank 0 waits for data"
    html = rendered["stepscope.email.html"]
    for text in ("Rank 0 waits 75%.", 'href="https://runbook.example/x"', "var-run=r1", "Raise num_workers.",
                 "run r1 rank 0 on n1"):
        assert text in html
    assert "<no value>" not in html


@pytest.mark.parametrize(("dashboard_url", "link"), [
    ("https://grafana.example/d/stepscope-training?var-run=r1", "https://grafana.example/d/stepscope-training?var-run=r1"),
    ("/d/stepscope-training?var-run=r1", "https://am.example"),
])
def test_the_title_link_opens_grafana_or_else_the_alertmanager(tmp_path: Path, dashboard_url: str, link: str) -> None:
    """Slack's title link and PagerDuty's link are the dashboard where Prometheus knows Grafana's address; without
    it (the chart's default alerting.grafanaUrl beside a Prometheus with no grafana_url label) the annotation is a
    bare path no chat or pager opens, and the link is the Alertmanager's page, as Alertmanager's default."""
    alert = {"status": "firing", "labels": {"alertname": "StepscopeRunNameClash", "run": "r1", "severity": "warning"},
             "annotations": {"dashboard_url": dashboard_url}}
    data = {"status": "firing", "alerts": [alert], "externalURL": "https://am.example"}
    (tmp_path / "data.json").write_text(json.dumps(data))
    result = amtool("template", "render", f"--template.glob={ALERTMANAGER_DIR / 'templates' / '*.tmpl'}",
                    '--template.text={{ template "stepscope.dashboard_url" . }}',
                    f"--template.data={tmp_path / 'data.json'}")
    assert result.returncode == 0, result.stderr
    assert result.stdout == link


def rendered(tmp_path: Path, name: str, data: dict, kind: str = "text") -> str:
    """Template `name` of the shipped templates as Alertmanager 0.25 renders it for `data` (amtool)."""
    (tmp_path / "data.json").write_text(json.dumps(data))
    result = amtool("template", "render", f"--template.glob={ALERTMANAGER_DIR / 'templates' / '*.tmpl'}",
                    f"--template.text={{{{ template \"{name}\" . }}}}", f"--template.type={kind}",
                    f"--template.data={tmp_path / 'data.json'}")
    assert result.returncode == 0, result.stderr
    return result.stdout


def bottleneck_alert(rank: int, share: str, ended: str | None = None) -> dict:
    """Rank `rank`'s StepscopeDataLoadingBottleneck as the webhook carries it: firing, or resolved at `ended`."""
    labels = {"alertname": "StepscopeDataLoadingBottleneck", "run": "r1", "rank": str(rank), "instance": f"n{rank}",
              "severity": "warning"}
    annotations = {"summary": f"Run r1 rank {rank} waits for data", "runbook": "Raise num_workers.",
                   "description": f"Rank {rank} of run r1 spends {share} of its step time waiting.",
                   "runbook_url": "https://runbook.example/x", "dashboard_url": "https://grafana.example/d/t?var-run=r1"}
    return {"status": "resolved" if ended else "firing", "labels": labels, "annotations": annotations,
            "startsAt": "2026-11-29T13:50:00Z", "endsAt": ended or "0001-01-01T00:00:00Z"}


@pytest.mark.parametrize("name", ["stepscope.text", "stepscope.email.html"])
def test_a_resolved_alert_says_it_ended_and_gives_no_advice(tmp_path: Path, name: str) -> None:
    """A resolved notification ended with "What to try" and the runbook link, its description in the present tense
    ("RESOLVED run r1 rank 0 on n0 (warning): Rank 0 ... spends 50% of its step time waiting"). It now says when the
    alert ended and what it said while firing; in a group with alerts still firing, the advice is theirs alone."""
    resolved = bottleneck_alert(0, "50%", ended="2026-11-29T14:03:05Z")
    group = {"status": "resolved", "alerts": [resolved], "externalURL": "https://am.example",
             "commonLabels": {"alertname": "StepscopeDataLoadingBottleneck", "run": "r1"}}
    alone = rendered(tmp_path, name, group, "html" if "html" in name else "text")
    ended = ("RESOLVED run r1 rank 0 on n0 (warning): ended at 2026-11-29 14:03:05 UTC, after firing since "
             "2026-11-29 13:50:00 UTC. While it fired it said: Rank 0 of run r1 spends 50% of its step time waiting.")
    assert ended in alone
    assert "What to try" not in alone and "runbook.example" not in alone and "Raise num_workers" not in alone
    mixed = rendered(tmp_path, name, {**group, "status": "firing", "alerts": [resolved, bottleneck_alert(1, "60%")]},
                     "html" if "html" in name else "text")
    assert ended in mixed and "Rank 1 of run r1 spends 60%" in mixed
    assert mixed.count("Raise num_workers") == 1 and mixed.count("runbook.example") == 1
    assert mixed.index("Raise num_workers") < mixed.index("RESOLVED")


@pytest.mark.parametrize("name", ["stepscope.text", "stepscope.email.html"])
def test_a_firing_alert_says_since_when_it_fires(tmp_path: Path, name: str) -> None:
    """A description states its alert's `for` ("for at least 10 minutes"), and Alertmanager repeats a firing alert
    every 4 hours with the same words: the person read how long the problem had lasted from nothing. Each firing
    alert now says since when it fires, as a resolved one says since when it fired."""
    group = {"status": "firing", "alerts": [bottleneck_alert(0, "50%")], "externalURL": "https://am.example"}
    text = rendered(tmp_path, name, group, "html" if "html" in name else "text")
    assert ", firing since 2026-11-29 13:50:00 UTC: Rank 0 of run r1 spends 50%" in text


@pytest.mark.parametrize(("labels", "where"), [
    ({"instance": "n9", "gpu": "0", "xid": "79", "severity": "critical"}, "GPU 0 on n9 (critical): "),
    ({"instance": "n9", "collector": "gpu", "severity": "warning"}, "node n9 (warning): "),
    ({"run": "r1", "rank": "3", "instance": "n9", "severity": "warning"}, "run r1 rank 3 on n9 (warning): "),
    ({"run": "r1", "gpu": "2", "instance": "n9", "severity": "info"}, "run r1 GPU 2 on n9 (info): "),
])
def test_each_alert_says_where_as_a_person_reads_it(tmp_path: Path, labels: dict[str, str], where: str) -> None:
    """A node's alert began "on n9 GPU 0 (critical)", as if the node were on the GPU, and a node alert "on n9"."""
    alert = {"status": "firing", "labels": {"alertname": "StepscopeX", **labels}, "annotations": {"description": "D."}}
    assert rendered(tmp_path, "stepscope.text", {"status": "firing", "alerts": [alert]}).startswith(where + "D.")


def test_a_data_bound_run_pages_once_with_its_cause_and_a_link(stack: Stack) -> None:
    """One notification for the run, its cause (the data loading) and not the GPU symptom that
    Prometheus fires too; the Slack message carries summary, description, links and what to try."""
    got = wait_for(lambda: stack.inbox.webhooks("databound"), 90, interval=0.5)
    assert got, "no notification for the data-bound run"
    # its waiting GPU is its cause's: muted in the rules while StepscopeDataLoadingBottleneck fires (an Alertmanager
    # inhibition never sent a muted alert's resolved), so Prometheus does not fire it past its `for`
    time.sleep(FOR_SECONDS["StepscopeGpuUnderutilized"] + GROUP_INTERVAL_SECONDS + 2)
    assert not firing_in_prometheus(stack.prometheus, "StepscopeGpuUnderutilized", "databound")
    (notification,) = stack.inbox.webhooks("databound")
    assert notification.body["commonLabels"]["alertname"] == "StepscopeDataLoadingBottleneck"
    (alert,) = notification.body["alerts"]
    assert alert["annotations"]["dashboard_url"] == f"{GRAFANA_URL}/d/stepscope-training?var-run=databound&var-rank=0"
    assert "grafana_url" not in alert["labels"]
    (slack,) = stack.inbox.slack("databound")
    attachment = slack["attachments"][0]
    assert attachment["title"] == "[FIRING:1] Run databound rank 0 waits for data"
    assert attachment["title_link"] == alert["annotations"]["dashboard_url"]
    since = alert["startsAt"][:19].replace("T", " ")  # to the second, in whatever zone Prometheus sent it
    for text in (f"run databound rank 0 on node-a (warning), firing since {since}",
                 "Rank 0 of run databound on node-a spends",
                 f"Dashboard: {alert['annotations']['dashboard_url']}",
                 "Runbook: https://github.com/stepscope/stepscope/blob/main/docs/alerts.md#stepscopedataloadingbottleneck",
                 "What to try: Raise DataLoader num_workers"):
        assert text in attachment["text"], attachment["text"]
    assert "<no value>" not in json.dumps(slack)


def test_a_gpu_bound_run_pages_nobody(stack: Stack) -> None:
    wait_for(lambda: stack.inbox.webhooks("databound"), 90, interval=0.5)  # as long as a page takes
    assert stack.inbox.webhooks("gpubound") == []


def test_a_run_on_two_nodes_is_one_alert_group_per_alert(stack: Stack) -> None:
    """Both nodes' alerts go to one group (alertname, run), so a person gets them in one notification. When
    the second node's alert fires after the group_wait (scaled down here to 2 s: a clean-clone CI run once
    fired them further apart) the group notifies first with one, then with both: never in two groups."""
    got = wait_for(lambda: [n for n in stack.inbox.webhooks("spread") if len(n.body["alerts"]) == 2], 90, interval=0.5)
    assert got, alertnames(stack.inbox.webhooks("spread"))
    notifications = stack.inbox.webhooks("spread")
    assert {n.body["groupKey"] for n in notifications} == {got[0].body["groupKey"]}
    for notification in notifications:
        assert notification.body["groupLabels"] == {"alertname": "StepscopeDataLoadingBottleneck", "run": "spread"}
    assert sorted(a["labels"]["instance"] for a in got[0].body["alerts"]) == ["node-a", "node-b"]


def test_an_exporter_restart_sends_the_person_no_resolved(stack: Stack) -> None:
    """node-b's exporter stopped for 3 s and started again while the two-node run `spread` pages for both
    nodes and the two-node run `lost` pages for its rank killed on node-b: Prometheus keeps both alerts
    firing since the same moment, the lost rank's though the new exporter forgot the rank, and Alertmanager
    sends no `resolved` for either (docs/alerts.md#scrape-gaps). Without the hold the alert resolved at the failed
    scrape, Alertmanager said so at its next group_interval, and the alert fired anew after its `for`."""
    assert wait_for(lambda: [n for n in stack.inbox.webhooks("spread") if len(n.body["alerts"]) == 2], 90, 0.5)

    def node_b_alert() -> list[dict]:
        return [alert for alert in firing_in_prometheus(stack.prometheus, "StepscopeDataLoadingBottleneck", "spread")
                if alert["labels"]["instance"] == "node-b"]

    def rank_lost() -> list[dict]:
        return firing_in_prometheus(stack.prometheus, "StepscopeRankLost", LOST)

    assert wait_for(lambda: stack.inbox.webhooks(LOST, "firing"), 90, 0.5), "the lost rank was not paged"
    (before,) = node_b_alert()
    (lost_before,) = rank_lost()
    assert (lost_before["labels"]["instance"], lost_before["labels"]["rank"]) == ("node-b", "1")
    sent = {run: len(stack.inbox.webhooks(run)) for run in ("spread", LOST)}
    stack.restart_exporter("node-b", 3)
    time.sleep(RESTART_WATCH_SECONDS)
    assert [alert["activeAt"] for alert in node_b_alert()] == [before["activeAt"]]
    # the restarted exporter forgot the lost rank; its alert goes on, and rank 0 on node-a is never lost
    assert not query(stack.prometheus, f'{TRAINING_LAST_PUSH}{{run="{LOST}",rank="1"}}')
    assert [alert["activeAt"] for alert in rank_lost()] == [lost_before["activeAt"]]
    resolved = [(run, alert["labels"]["instance"]) for run in sent
                for notification in stack.inbox.webhooks(run)[sent[run]:]
                for alert in notification.body["alerts"] if alert["status"] == "resolved"]
    assert resolved == []


def test_a_stalled_run_pages_for_itself_and_holds_back_nobody(stack: Stack) -> None:
    """The stalled run's critical ends its own GPU symptom (in the rules), not the data-bound run's page on the
    same node (it arrives within group_wait of Prometheus firing it) nor, once that run closes, its
    resolved (within RESOLVED_BOUND_SECONDS)."""
    stalled = wait_for(lambda: stack.inbox.webhooks("stalled"), 90, interval=0.5)
    assert alertnames(stalled) == ["StepscopeTrainingStalled"], alertnames(stalled)
    assert "pid" in stalled[0].body["alerts"][0]["annotations"]["description"]
    first = wait_for(lambda: stack.inbox.webhooks("databound", "firing"), 90, interval=0.5)
    assert first
    (fired,) = firing_in_prometheus(stack.prometheus, "StepscopeDataLoadingBottleneck", "databound")
    active_at = datetime.fromisoformat(fired["activeAt"].replace("Z", "+00:00")).timestamp()
    fired_at = active_at + FOR_SECONDS["StepscopeDataLoadingBottleneck"]
    print(f"first page {first[0].wall - fired_at:.1f} s after Prometheus fired it (bound {PAGE_BOUND_SECONDS} s)")
    assert first[0].wall - fired_at <= PAGE_BOUND_SECONDS
    trainer = stack.trainers[("databound", 0)]
    closed = time.monotonic()
    trainer.send_signal(signal.SIGTERM)  # the hooks push state idle, then the process exits
    trainer.wait(timeout=20)
    assert wait_for(lambda: not firing_in_prometheus(stack.prometheus, "StepscopeDataLoadingBottleneck", "databound"),
                    60, interval=0.2)
    cleared = time.monotonic()
    resolved = wait_for(lambda: stack.inbox.webhooks("databound", "resolved"), RESOLVED_BOUND_SECONDS + 20, 0.2)
    assert resolved, "no resolved notification for the closed run"
    delay = resolved[0].at - cleared
    print(f"resolved {delay:.1f} s after Prometheus resolved it, {resolved[0].at - closed:.1f} s after the run closed "
          f"(bound {RESOLVED_BOUND_SECONDS} s)")
    assert delay <= RESOLVED_BOUND_SECONDS
    assert firing_in_prometheus(stack.prometheus, "StepscopeTrainingStalled", "stalled"), "the critical still fires"
    assert stack.inbox.webhooks("stalled", "resolved") == []
    # the critical also woke the pager, once for the run; the warning did not
    paged = stack.inbox.webhooks("stalled", path="/page")
    assert alertnames(paged) == ["StepscopeTrainingStalled"], alertnames(paged)
    assert stack.inbox.webhooks("databound", path="/page") == []
    # the stalled run's waiting GPU is its stall's: muted in the rules while the stall pages
    assert not firing_in_prometheus(stack.prometheus, "StepscopeGpuUnderutilized", "stalled")
    assert "StepscopeGpuUnderutilized" not in alertnames(stack.inbox.webhooks("stalled"))


def test_every_runbook_url_opens_its_row_in_the_alerts_page() -> None:
    """runbook_url points at the alert's row of the alert table in docs/alerts.md (an anchor there)."""
    page = (REPO_ROOT / "docs" / "alerts.md").read_text()
    for rule in rules():
        if "alert" in rule:
            url = rule["annotations"]["runbook_url"]
            assert url == f"{ALERTS_PAGE_URL}#{rule['alert'].lower()}", url
            assert f'<a id="{rule["alert"].lower()}"></a>`{rule["alert"]}`' in page, rule["alert"]


def test_every_runbook_holds_for_every_alert_of_its_group() -> None:
    """stepscope.tmpl shows a group's runbook once, its first alert's, under the alerts: a runbook that named
    its alert's node ("Open the Node dashboard for n3") sent a run's stragglers on n3 and n4 to n3 alone. Each
    alert's description names where; its runbook says what to do, the same for every alert of the rule."""
    for rule in rules():
        if "alert" in rule:
            assert "{{" not in rule["annotations"]["runbook"], rule["alert"]


def post_alert(alertmanager: str, labels: dict[str, str], resolved: bool = False) -> None:
    """One alert as Prometheus sends it: firing (ends in an hour, resent while it holds) or resolved now."""
    ends = time.time() + (0 if resolved else 3600)
    annotations = {"summary": f"{labels['alertname']} of {labels['run']}", "runbook": "Act on it.",
                   "description": f"{labels['alertname']} holds."}
    alert = {"labels": labels, "annotations": annotations,
             "endsAt": datetime.fromtimestamp(ends).astimezone().isoformat()}
    requests.post(f"{alertmanager}/api/v2/alerts", json=[alert], timeout=10).raise_for_status()


def test_a_warning_that_resolves_while_its_run_stalls_is_told_resolved(alertmanager: str, webhook) -> None:
    """The shipped config mutes nothing, so every notified alert's `resolved` is sent. With the inhibition
    shipped before (a stalled run mutes its warnings) a warning notified, then resolved while the stall paged,
    was never told resolved (prometheus/alertmanager#2754): its message stayed open for good, the person
    learning of the stall's end only. The rules now end the run's warnings while the stall pages
    (grafana/rules/tests/stall_mutes.yml), so the person hears `resolved` for the warning when the stall starts."""
    inbox = webhook[1]
    warning = {"alertname": "StepscopeDataLoadingBottleneck", "severity": "warning", "run": "am-hang", "rank": "0",
               "instance": "i1"}
    stall = {"alertname": "StepscopeTrainingStalled", "severity": "critical", "run": "am-hang"}
    post_alert(alertmanager, warning)
    assert wait_for(lambda: inbox.webhooks("am-hang", "firing"), 20, 0.2), "the warning was never notified"
    post_alert(alertmanager, stall)
    post_alert(alertmanager, warning, resolved=True)
    told = wait_for(lambda: [n for n in inbox.webhooks("am-hang", "resolved")
                             if n.body["commonLabels"]["alertname"] == warning["alertname"]], 20, 0.2)
    assert told, [(n.body["status"], n.body["commonLabels"]) for n in inbox.webhooks("am-hang")]
    # the person's chat says it ended, with nothing to act on (it ended "What to try: Act on it.")
    (said,) = [m["attachments"][0]["text"] for m in inbox.slack("am-hang")
               if m["attachments"][0]["title"].startswith("[RESOLVED]")]
    assert said.startswith("RESOLVED run am-hang rank 0 on i1 (warning): ended at ") and "What to try" not in said
    post_alert(alertmanager, stall, resolved=True)


def test_a_scrape_config_too_rare_for_the_rules_is_one_notification_for_all_its_nodes(alertmanager: str,
                                                                                     webhook) -> None:
    """StepscopeScrapeIntervalTooLong is one setting's mistake (the job's scrape_interval), which a cluster-wide 60 s
    config makes on every node: under the root's grouping (alertname, instance) three nodes were three
    notifications of the same cause; it is grouped by job now: one, naming the three."""
    inbox = webhook[1]
    for node in ("sparse-1", "sparse-2", "sparse-3"):
        labels = {"alertname": "StepscopeScrapeIntervalTooLong", "severity": "warning", "job": "stepscope-sparse",
                  "instance": node}
        alert = {"labels": labels, "annotations": {"summary": f"{node} is scraped too rarely", "description": "."},
                 "endsAt": datetime.fromtimestamp(time.time() + 3600).astimezone().isoformat()}
        requests.post(f"{alertmanager}/api/v2/alerts", json=[alert], timeout=10).raise_for_status()

    def notified() -> list[Notification]:
        with inbox.lock:
            return [n for n in inbox.received if n.path == "/webhook"
                    and n.body["commonLabels"].get("job") == "stepscope-sparse"]
    assert wait_for(notified, 20, 0.2), "never notified"
    time.sleep(GROUP_INTERVAL_SECONDS + GROUP_WAIT_SECONDS)  # a group per node would have sent its own by now
    (notification,) = notified()
    assert sorted(alert["labels"]["instance"] for alert in notification.body["alerts"]) == [
        "sparse-1", "sparse-2", "sparse-3"]


def test_hints_take_their_own_route() -> None:
    """amtool's route test on the shipped config: info to `info`, run and node alerts to `default`, critical ones
    to the pager too."""
    config = str(ALERTMANAGER_DIR / "alertmanager.yml")
    for receiver, labels in (("info", ["alertname=StepscopeTensorCoresIdle", "severity=info", "run=r", "gpu=0"]),
                             ("default", ["alertname=StepscopeDataLoadingBottleneck", "severity=warning", "run=r"]),
                             ("default", ["alertname=StepscopeGpuThrottling", "severity=warning", "instance=n"]),
                             ("page,default", ["alertname=StepscopeGpuDown", "severity=critical", "instance=n"]),
                             ("page,default", ["alertname=StepscopeRankLost", "severity=critical", "run=r"])):
        result = amtool("config", "routes", "test", f"--config.file={config}", f"--verify.receivers={receiver}",
                        *labels)
        assert result.returncode == 0, result.stdout + result.stderr
