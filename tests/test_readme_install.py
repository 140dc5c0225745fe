"""The README's first command, as a new user runs it: a fresh virtualenv in a copy of the checkout
(wheels from pip's cache), the exporter serving, then the report extra installed into that venv.
Its own module: it is the suite's longest single test and runs beside the rest (pytest-xdist)."""

import shutil
import subprocess
from pathlib import Path

import requests

from stepscope_testkit.processes import REPO_ROOT, free_port, wait_http_ok
from tests.support.readme import readme_command, readme_commands, shell_env, start_shell, stop_shells


def installed_top_level_names(venv: Path) -> set[str]:
    """The import names the installed distribution put into site-packages, from its RECORD (scripts
    and its own .dist-info left out): each must be ours alone, so nothing shadows or is shadowed."""
    (record,) = venv.glob("lib/python*/site-packages/stepscope-*.dist-info/RECORD")
    paths = (line.split(",")[0] for line in record.read_text().splitlines())
    return {path.split("/")[0] for path in paths if not path.startswith("..") and ".dist-info/" not in path}


def test_the_first_command_installs_and_serves_from_a_fresh_venv(tmp_path: Path) -> None:
    """In a copy of the checkout (its own .venv), with wheels from pip's cache."""
    checkout = tmp_path / "stepscope"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        source, target = REPO_ROOT / name, checkout / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # stepscope/<subpackage> -> the top-level folder
            target.symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target)
    port = free_port()
    first = readme_commands()[0]
    env = shell_env({"STEPSCOPE_WEB_LISTEN_ADDRESS": f"127.0.0.1:{port}"}, bin_dir=Path("/usr/bin"))
    env.pop("PYTHONPATH")
    shell = start_shell(first, tmp_path / "first.log", env, cwd=checkout)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/-/ready", shell, timeout=240)
        assert "stepscope_exporter_build_info" in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert installed_top_level_names(checkout / ".venv") == {"stepscope"}
    except Exception:
        print((tmp_path / "first.log").read_text(errors="replace"))
        raise
    finally:
        stop_shells({"first": shell})
    venv = shell_env(bin_dir=checkout / ".venv" / "bin")
    venv.pop("PYTHONPATH")
    # the extra is resolved and the project built, as the command does; --dry-run leaves out only
    # unpacking matplotlib and its dependencies (the report tests run it from the test venv)
    install_report = readme_command("pip install '.[report]'").replace("pip install", "pip install --dry-run")
    for line in (install_report, readme_command("python -m stepscope.report --help")):
        result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=venv, cwd=checkout,
                                timeout=300)
        assert result.returncode == 0, f"{line}: {result.stderr[-2000:]}"
        if "--dry-run" in line:
            assert "Would install" in result.stdout and "matplotlib" in result.stdout, result.stdout
    assert "--prometheus" in result.stdout
    assert (checkout / ".venv" / "bin" / "stepscope-report").is_file()
