"""Every command in the ```bash blocks of the README and of the reference pages (docs/*.md) is run here
or in the test named in RUN_HERE, as written, or listed in NOT_RUN with the reason and what is checked
instead. A command added to a page without either fails the first test; a page missing from the index
(docs/README.md) or a relative link that leads nowhere fails the next two.

The commands run through `bash -c` with the virtualenv's bin first on PATH, as in an activated venv.
Only what would collide between parallel runs is changed, each where the README itself allows it:
the exporter's :9847 moves by STEPSCOPE_WEB_LISTEN_ADDRESS and the hooks follow by STEPSCOPE_PUSH_URL;
the Pushgateway's :9091 moves to a free port in all three of its commands; forever-running commands
are stopped once they have shown what they are for.
"""

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import helm_python
import pytest
import tomllib
import yaml

from stepscope.exporter.web_config import load
from stepscope_testkit.processes import REPO_ROOT, free_port, running_exporter, sample_values, scrape, wait_http_ok
from tests.support.helm_chart import CHART, OPERATOR_API, objects, render
from tests.support.readme import (
    DOCS,
    README,
    doc_section,
    documented_commands,
    documents,
    readme_command,
    shell_env,
    start_shell,
    stop_shells,
)

RUN_HERE = {  # command prefix -> the test that runs it
    "python3 -m venv .venv && .venv/bin/pip install '.[exporter]'": "test_readme_install.py",
    "pip install '.[report]'": "test_readme_install.py",
    "python -m stepscope.report --help": "test_readme_install.py",
    "python -m stepscope.hooks.demo": "test_the_demo_and_profile_commands",
    "torchrun --nproc-per-node 2 -m stepscope.hooks.demo": "test_the_demo_and_profile_commands",
    "prometheus-pushgateway": "test_the_demo_and_profile_commands",
    "curl -s http://127.0.0.1:9091/metrics": "test_the_demo_and_profile_commands",
    "stepscope-profile": "test_the_demo_and_profile_commands",
    "stepscope-report --prometheus": "test_report_e2e.py::test_the_readme_report_command",
    "python -m grafana generate": "test_generate.py: --check on the repository as a subprocess, generate "
                                  "(through its main) on a copy with stale and hand-edited files",
    ".venv/bin/pip install '.[exporter,torch,report]'": "test_quickstart.py (resolved with --dry-run)",
    ".venv/bin/stepscope-quickstart": "test_quickstart.py",
}
NOT_RUN = {  # command prefix -> why not here, and what is checked instead
    "bash scripts/test.sh": "it is this test suite (.ci/run runs it); test_the_test_command_is_what_ci_runs",
    "sudo apt-get install prometheus": "installs a system package as root; scripts/test.sh installs the same "
                                       "Debian package, and test_quickstart.py checks that the quickstart names "
                                       "this command when prometheus is missing",
    ".venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu": (
        "downloads torch; scripts/test.sh installs torch from the same index into the venv the tests run in"),
    "docker ": "no Docker engine here (and no compose plugin); test_the_image_names_agree checks the "
               "names, targets and files these commands use, test_compose.py the compose file",
    "kubectl ": "needs a Kubernetes cluster; the chart is rendered with the README's values instead",
    "helm install": "needs a cluster (and the helm CLI); test_the_helm_install_values_render renders "
                    "and lints the chart with these --set values through the Helm SDK",
    "helm test": "needs a cluster; test_the_helm_install_values_render checks the test pod is rendered",
    "sudo useradd ": "bare-metal install as root, system-wide (docs/deployment.md, Bare metal and Slurm); "
                     "test_systemd_deploy.py runs the unit's ExecStart as an unprivileged user with the unit's "
                     "capabilities and env file, and the install command itself is test_readme_install.py's",
    "sudo /usr/bin/python3 -m venv /opt/stepscope": "the same bare-metal install; test_readme_install.py runs its "
                                                     "venv and pip install '.[exporter]' in a temporary folder",
    "sudo /opt/stepscope/bin/pip install": "the same; test_readme_install.py",
    "sudo install ": "copies the shipped files under /etc as root; test_systemd_deploy.py reads them where they are",
    "sudo systemctl ": "needs systemd as PID 1 (none here); test_systemd_deploy.py verifies the unit with "
                       "systemd-analyze and runs its ExecStart",
    "curl -s http://127.0.0.1:9847/-/healthy": "the installed service's health; test_systemd_deploy.py scrapes "
                                               "the unit's exporter",
    "PYTHONPATH=. .venv/bin/python benchmarks/": "benchmarks take minutes each and write benchmarks/results/ "
                                                 "(timing budgets live there, never in tests); "
                                                 "test_the_benchmark_scripts_exist_and_compile",
}


def _matches(command: str, table: dict[str, str]) -> list[str]:
    return [prefix for prefix in table if command.startswith(prefix)]


def test_every_documented_command_is_run_or_explained() -> None:
    commands = documented_commands()
    assert len(commands) > 20
    for command in commands:
        assert len(_matches(command, RUN_HERE) + _matches(command, NOT_RUN)) == 1, (
            f"documented command {command!r}: run it in a test (RUN_HERE) or say why not (NOT_RUN)")


def test_every_reference_page_is_in_the_index() -> None:
    index = (DOCS / "README.md").read_text()
    pages = {path.name for path in documents()} - {"README.md"}
    listed = set(re.findall(r"^\| \[[\w.-]+\]\(([\w.-]+\.md)\) \|", index, flags=re.M))
    assert pages == listed, f"a row of docs/README.md's table for each docs/*.md page: {sorted(pages ^ listed)}"
    assert "(docs/README.md)" in README.read_text()


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page: its headings' slugs and its explicit ids."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}
    return slugs | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_every_relative_link_leads_somewhere() -> None:
    """The guide and the reference link each other by file and anchor: a moved section breaks no link."""
    broken = []
    for path in documents():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and anchor not in _anchors(linked.read_text())):
                broken.append(f"{path.relative_to(REPO_ROOT)}: {target}")
    assert broken == []


def _wait(condition: Callable[[], bool], what: str, processes: dict[str, subprocess.Popen], logs: Path,
          timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for name, process in processes.items():
            if process.poll() is not None:
                log = (logs / f"{name}.log").read_text(errors="replace")
                raise AssertionError(f"{name} exited with {process.returncode} while waiting for {what}:\n{log}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_demo_and_profile_commands(tmp_path: Path) -> None:
    """All demo commands at once against one real exporter (and the Pushgateway block against a real
    Pushgateway), each stopped once it has pushed steps; then both stepscope-profile commands against a
    rank of run resnet-a."""
    gateway_port = free_port()
    demo_lines = [c for c in documented_commands()
                  if c.startswith(("python -m stepscope.hooks.demo", "torchrun")) and "9091" not in c]
    assert len(demo_lines) == 5
    pushgateway_block = [c.replace("127.0.0.1:9091", f"127.0.0.1:{gateway_port}").removesuffix("&").strip()
                         for c in documented_commands() if "9091" in c]
    assert len(pushgateway_block) == 3 and pushgateway_block[0].startswith("prometheus-pushgateway")
    with running_exporter(tmp_path, "--collectors", "") as exporter:
        env = shell_env({"STEPSCOPE_PUSH_URL": exporter.url, "STEPSCOPE_PUSH_INTERVAL": "0.5",
                         "STEPSCOPE_TRACE_DIR": str(tmp_path / "traces")})
        shells = {"pushgateway": start_shell(pushgateway_block[0], tmp_path / "pushgateway.log", env)}
        try:
            gateway = f"http://127.0.0.1:{gateway_port}"
            wait_http_ok(f"{gateway}/-/ready", shells["pushgateway"])
            demos = dict(zip(["demo", "straggler", "slow", "fixed", "ddp", "pushgateway-demo"],
                             [*demo_lines, pushgateway_block[1]], strict=True))
            # a rank 3 of run resnet-a, for the profile commands (not a README command: the user's job), in
            # steps of 5+ ms so that it does not take a core while they trace
            demos["resnet-a"] = ("python -m stepscope.hooks.demo --run resnet-a --rank 3 --world-size 4"
                                 " --extra-step-seconds 0.005")
            shells.update({name: start_shell(line, tmp_path / f"{name}.log", env) for name, line in demos.items()})

            def pushed(*groups: tuple[str, str]) -> Callable[[str], bool]:
                return lambda text: all(sample_values(text, "stepscope_steps_total", run=run, rank=rank) >= [3]
                                        for run, rank in groups)

            def on_gateway(_: str) -> bool:
                return pushed(("demo", "0"))(scrape(gateway))

            shown = {"demo": pushed(("demo", "0")), "straggler": pushed(("demo", "1")), "slow": pushed(("slow", "0")),
                     "fixed": pushed(("fixed", "0")), "ddp": pushed(("ddp", "0"), ("ddp", "1")),
                     "pushgateway-demo": on_gateway, "resnet-a": pushed(("resnet-a", "3"))}

            running = {name: shells[name] for name in demos}  # what must not exit by itself
            seen: dict[str, str] = {}  # what the exporter (the Pushgateway) showed of a demo when it was stopped

            def stop_those_done() -> bool:
                text = scrape(exporter.url)
                for name in [n for n in shown if shown[n](text)]:
                    del shown[name]
                    seen[name] = scrape(gateway) if name == "pushgateway-demo" else text
                    if name != "resnet-a":  # it stays for the traces
                        stop_shells({name: running.pop(name)})  # training flat out costs the other tests CPU
                return not shown

            _wait(stop_those_done, "every demo's steps", running, tmp_path)
            curl = subprocess.run(["bash", "-c", pushgateway_block[2]], capture_output=True, text=True, env=env)
            assert 'stepscope_steps_total{' in curl.stdout and 'run="demo"' in curl.stdout, curl.stdout
            for line in [c for c in documented_commands() if c.startswith("stepscope-profile")]:
                result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=150)
                assert result.returncode == 0, result.stderr
                (trace,) = result.stdout.split()
                assert Path(trace).is_file() and trace.endswith(".pt.trace.json.gz")
        finally:
            stop_shells(shells)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in demos}
    assert "the loader is the limit" in logs["slow"], logs["slow"]  # as the README's comments say
    assert "the training step is the limit" in logs["fixed"], logs["fixed"]
    assert not [name for name, log in logs.items() if "Traceback" in log and name != "ddp"], logs
    # what the straggler and the data-bound run say they do, in their pushed sums
    assert logs["straggler"].startswith(f"stepscope demo: run=demo rank=1/4 pushing to {exporter.url}")
    assert logs["pushgateway-demo"].startswith(f"stepscope demo: run=demo rank=0/1 pushing to {gateway}")
    straggler = {"run": "demo", "rank": "1"}
    [steps] = sample_values(seen["straggler"], "stepscope_steps_total", **straggler)
    [forward] = sample_values(seen["straggler"], "stepscope_step_phase_seconds_sum", phase="forward", **straggler)
    assert forward >= steps * 0.05
    data_bound = {"job": "stepscope", "run": "demo", "rank": "0"}
    [steps] = sample_values(seen["pushgateway-demo"], "stepscope_steps_total", **data_bound)
    assert sample_values(seen["pushgateway-demo"], "stepscope_samples_total", **data_bound) == [steps * 64]
    [loading] = sample_values(seen["pushgateway-demo"], "stepscope_step_phase_seconds_sum", phase="dataloader_next",
                              **data_bound)
    assert loading >= steps * 0.1


def test_the_web_config_example_loads(tmp_path: Path) -> None:
    """Not a command, but copied as one: the documented web.yml passes the exporter's checks."""
    text = doc_section("exporter")
    example = text[text.index("# web.yml: --web.config.file"):]
    (tmp_path / "web.yml").write_text(example[:example.index("```")])
    config = load(str(tmp_path / "web.yml"))
    assert config.tls is not None and config.tls.client_ca_file == str(tmp_path / "clients-ca.crt")
    assert list(config.users) == ["prometheus"]
    assert config.headers == {"X-Frame-Options": "deny", "X-Content-Type-Options": "nosniff"}


def test_the_helm_install_values_render(tmp_path: Path) -> None:
    install = readme_command("helm install")
    words = install.split()
    assert words[3] == "./helm/stepscope" and (REPO_ROOT / words[3]).resolve() == CHART
    chart = CHART  # as committed: files/dashboards links to grafana/dashboards_out
    values: dict = {}
    for index, word in enumerate(words):
        if word == "--set":
            key, value = words[index + 1].split("=", 1)
            node = values
            *parents, leaf = key.split(".")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
    rendered = render(chart, values, api_versions=[OPERATOR_API])
    objs = objects(rendered)
    kinds = {o["kind"]: o for o in objs}
    assert kinds["ServiceMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert kinds["PrometheusRule"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    (container,) = kinds["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    pushed = readme_command("docker push").split()[-1]
    assert container["image"] == pushed == f"registry.example.com/stepscope-exporter:{app_version}"
    assert objects(rendered, tests=True), "helm test needs the test pod"
    report = helm_python.lint(chart, values, strict=True, namespace="stepscope", kube_version="v1.30.0")
    assert not [m for m in report.get("messages", []) if m.get("severity", 0) >= 2], report


def test_the_image_names_agree() -> None:
    """README's docker build tags = compose's image names = the Dockerfile's own comments; the
    targets, files and the tag pushed for the chart exist."""
    builds = [c.split() for c in documented_commands() if c.startswith("docker build")]
    tags = {words[words.index("-t") + 1] for words in builds}
    assert tags == {"stepscope-exporter:local", "stepscope-demo:local"}
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    for words in builds:
        assert (REPO_ROOT / words[words.index("-f") + 1]).is_file()
        if "--target" in words:
            assert f" AS {words[words.index('--target') + 1]}\n" in dockerfile
        assert f"-t {words[words.index('-t') + 1]} ." in dockerfile  # its header says the same
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    assert {service.get("image") for service in compose["services"].values()} >= tags
    for command in (c for c in documented_commands() if c.startswith("docker compose")):
        words = command.split()
        for index, word in enumerate(words):
            if word == "-f":
                assert (REPO_ROOT / words[index + 1]).is_file()
    tagged_from, _ = readme_command("docker tag").split()[2:4]
    assert tagged_from in tags


def test_the_test_command_is_what_ci_runs() -> None:
    assert "exec bash scripts/test.sh" in (REPO_ROOT / ".ci" / "run").read_text()
    assert (REPO_ROOT / "scripts" / "test.sh").is_file()


def test_the_readme_names_every_module_the_test_script_runs_alone() -> None:
    """README said "the three modules whose rules must keep a 1 s evaluation (the replay, the energy checks)" while
    four ran alone beside the quickstart (goodput and dropped bounds joined later): it names each module now."""
    alone = re.compile(r"^(?:pytestmark = .*|@)pytest\.mark\.alone\b", re.M)
    marked = {path.name for path in (REPO_ROOT / "tests").glob("test_*.py") if alone.search(path.read_text())}
    paragraph = README.read_text().split("bash scripts/test.sh", 2)[1].split("`.ci/run`", 1)[0]
    assert set(re.findall(r"`(test_\w+\.py)`", paragraph)) == marked


def _phases_collect(*args: str) -> list[set[str]]:
    """The test modules each phase of scripts/test_phases.sh collects with these arguments."""
    out = subprocess.run(["bash", "scripts/test_phases.sh", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                          *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    phases = out.stdout.split(" collected")  # each phase ends with 'N/M tests collected (K deselected)'
    return [{line.split("::")[0] for line in phase.splitlines() if "::" in line} for phase in phases[:-1]]


@pytest.mark.parametrize("marker", [["-m", "not gpu"], ["-mnot gpu"]])
def test_a_marker_argument_narrows_each_phase_rather_than_replacing_them(marker: list[str]) -> None:
    modules = ["tests/test_energy_e2e.py", "tests/test_hooks_gpu.py", "tests/test_packaging.py", "tests/test_rules.py"]
    beside_others, alone, background = _phases_collect(*marker, *modules)
    assert beside_others == {"tests/test_packaging.py"}  # not alone, not background, not gpu
    assert alone == {"tests/test_energy_e2e.py"}  # alone, not gpu; each phase once
    assert background == {"tests/test_rules.py"}


BACKGROUND_MODULE = """
import os, pathlib, subprocess, sys, time
import pytest
pytestmark = pytest.mark.background
def test_fails():
    assert False, "a background failure"
def test_waits():  # with a child of its own, as promtool is
    sleep = os.environ["STEPSCOPE_TEST_SLEEP"]
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({sleep})", __file__])
    pathlib.Path(os.environ["STEPSCOPE_TEST_STARTED"]).touch()
    child.wait()
"""


def _phases(module: Path, sleep: float, started: Path) -> subprocess.Popen:
    """scripts/test_phases.sh on one module, in a session of its own with Ctrl-C's default (a terminal's)."""
    env = {**os.environ, "STEPSCOPE_TEST_SLEEP": str(sleep), "STEPSCOPE_TEST_STARTED": str(started)}
    return subprocess.Popen(["bash", "scripts/test_phases.sh", str(module), "-c", "pyproject.toml", "-q", "-n", "0",
                             "-p", "no:cacheprovider"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_a_failing_background_test_fails_the_run_and_its_output_comes_last(tmp_path: Path) -> None:
    module = tmp_path / "test_lane.py"
    module.write_text(BACKGROUND_MODULE)
    script = _phases(module, 0, tmp_path / "started")
    out, _ = script.communicate(timeout=120)
    assert script.returncode == 1, out
    assert "AssertionError: a background failure" in out
    assert out.strip().splitlines()[-1].startswith("1 failed, 1 passed in "), out


def test_the_alone_phase_orders_every_alone_module_longest_first() -> None:
    """A module marked alone and missing from ALONE_LONGEST_FIRST would start last and run on after the others."""
    from tests.conftest import ALONE_LONGEST_FIRST

    alone = re.compile(r"^(?:pytestmark = .*|@)pytest\.mark\.alone\b", re.M)
    marked = {path.name for path in (REPO_ROOT / "tests").glob("test_*.py") if alone.search(path.read_text())}
    assert sorted(ALONE_LONGEST_FIRST) == sorted(marked)


def test_ctrl_c_in_the_alone_phase_stops_the_background_lane_too(tmp_path: Path) -> None:
    module = tmp_path / "test_lane.py"
    module.write_text(BACKGROUND_MODULE)
    started = tmp_path / "started"
    script = _phases(module, 120, started)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), "the background test never started"
        os.killpg(script.pid, signal.SIGINT)
        assert script.wait(timeout=15) == 130
        deadline = time.monotonic() + 10
        while _running(module) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(module), _running(module)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", str(module)], check=False)


def _running(module: Path) -> list[str]:
    """Processes whose command line names the module (pytest runs of it)."""
    found = subprocess.run(["pgrep", "-af", str(module)], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def test_a_dangling_marker_flag_is_refused_with_a_message() -> None:
    out = subprocess.run(["bash", "scripts/test_phases.sh", "tests/test_packaging.py", "-m"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 4 and out.stderr.strip() == "scripts/test.sh: -m needs a marker expression"


def test_the_benchmark_scripts_exist_and_compile() -> None:
    """Each benchmark has a command in the docs: five (bench_auth_flood, bench_dashboard_queries, bench_http_cost,
    bench_push_starvation, bench_verdict_delay) had none, though the pages cite their results."""
    scripts = {c.split()[2] for c in documented_commands() if c.startswith("PYTHONPATH=. .venv/bin/python benchmarks/")}
    assert {f"benchmarks/{path.name}" for path in (REPO_ROOT / "benchmarks").glob("bench_*.py")} - scripts == set()
    for script in scripts:
        compile((REPO_ROOT / script).read_text(), script, "exec")


def test_pyproject_extras_the_readme_names_exist() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = "".join(path.read_text() for path in documents())
    for extra in ("torch", "lightning", "transformers", "report"):
        assert extra in extras and f"[{extra}]" in text
    assert not re.search(r"pip install '?stepscope\[", text), "stepscope is not on PyPI: install extras from a checkout"
