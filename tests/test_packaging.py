"""What `pip install stepscope` puts where: every import name under `stepscope`, the hooks without the
exporter's server libraries, and a clear message from the exporter's scripts when its extra is missing.
(The installed wheel's top-level names are checked on the README's first command, test_readme_install.)"""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stepscope_testkit.processes import REPO_ROOT

OLD_NAMES = ("exporter", "training_hooks", "run_report", "stepscope_contract")
SERVER_DISTRIBUTIONS = {"h11", "bcrypt", "pyyaml", "nvidia-ml-py"}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return [REPO_ROOT / name for name in names.stdout.split()
            if name.endswith((".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".tpl")) or name.endswith("Dockerfile")]


def test_nothing_imports_or_runs_a_module_by_its_old_top_level_name() -> None:
    """The folders keep their names, but code, docs and charts use only `stepscope.*`: an old name
    would work in this checkout (its root is on sys.path) and fail where the wheel is installed."""
    old = "|".join(OLD_NAMES)
    # `import a, b as c` too: the scripts the tests start are strings that an editor's import checks never see
    pattern = re.compile(rf"^\s*(from|import) ({old})\b|^\s*import (?:[\w.]+(?: as \w+)?\s*,\s*)+({old})\b"
                         rf"|-m ({old})\b|\"-m\", \"({old})\b", re.M)
    offenders = [f"{path.relative_to(REPO_ROOT)}: {match.group(0).strip()}"
                 for path in tracked_text_files() if path.is_file()
                 for match in pattern.finditer(path.read_text(errors="replace"))]
    assert offenders == []


def resolved_distributions(requirement: str) -> set[str]:
    """The distributions pip would install into an empty environment for `requirement`."""
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
         requirement], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    return {item["metadata"]["name"].lower() for item in json.loads(report.stdout)["install"]}


@pytest.mark.parametrize(("requirement", "server_libraries"), [(".", False), (".[exporter]", True)])
def test_the_hooks_install_without_the_exporters_server_libraries(requirement: str, server_libraries: bool) -> None:
    resolved = resolved_distributions(requirement)
    assert "stepscope" in resolved
    assert (resolved >= SERVER_DISTRIBUTIONS) if server_libraries else not (SERVER_DISTRIBUTIONS & resolved)


def test_the_exporter_without_its_extra_says_how_to_install_it() -> None:
    """As in an environment with only `pip install stepscope` (a module set to None is one Python
    cannot import): one line naming the extra, exit code 2, no traceback."""
    code = textwrap.dedent("""
        import sys
        sys.modules["h11"] = None
        sys.modules["bcrypt"] = None
        from stepscope.exporter.launch import main
        main()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("stepscope-exporter: needs the exporter extra (missing h11, bcrypt): "
                             "pip install 'stepscope[exporter]'\n")


def test_the_exporter_imports_only_what_it_serves_with() -> None:
    """Each of these cost the exporter's RSS without serving it (issue 20: no more RSS than nvitop-exporter):
    aiohttp (11 MiB) and prometheus_client (2 MiB, http.server and email with it) are not used, yaml and
    bcrypt load only with a web config file and at the first password check."""
    code = ("import sys, stepscope.exporter.cli, stepscope.exporter.daemon; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                            check=True)
    loaded = set(result.stdout.split())
    assert not loaded & {"aiohttp", "prometheus_client", "yaml", "bcrypt", "wsgiref", "email", "grpc"}, loaded
    assert "h11" in loaded
