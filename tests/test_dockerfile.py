"""The exporter image: pinned bases, non-root final stage, a health check, NVML through the NVIDIA
runtime, and the same install and entry point as the README and pyproject."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
from dockerfile_parse import DockerfileParser

from stepscope.exporter.cli import DEFAULT_PORT
from stepscope_testkit.processes import free_port, running_exporter
from tests.support.readme import doc_section

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"


@pytest.fixture(scope="module")
def stages() -> list[list[dict[str, Any]]]:
    """Instructions grouped by build stage, in order."""
    grouped: list[list[dict[str, Any]]] = []
    for instruction in DockerfileParser(path=str(DOCKERFILE)).structure:
        if instruction["instruction"] == "FROM":
            grouped.append([])
        if grouped:
            grouped[-1].append(instruction)
    return grouped


def values(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == name]


def env_of(stage: list[dict[str, Any]]) -> dict[str, str]:
    env = {}
    for value in values(stage, "ENV"):
        env.update(pair.split("=", 1) for pair in shlex.split(value))
    return env


def test_base_images_are_pinned_to_a_version(stages: list[list[dict[str, Any]]]) -> None:
    parser = DockerfileParser(path=str(DOCKERFILE))
    assert len(parser.parent_images) == len(stages) >= 2
    for image in parser.parent_images:
        repository, _, tag = image.rpartition(":")
        assert repository and re.match(r"\d+\.\d+\.\d+-", tag), f"{image} is not pinned to a version tag"


def test_readme_names_the_pinned_base_image() -> None:
    section = doc_section("deployment")
    images = set(DockerfileParser(path=str(DOCKERFILE)).parent_images)
    assert images and all(f"`{image.removeprefix('docker.io/library/')}`" in section for image in images), images


def test_final_stage_runs_as_non_root(stages: list[list[dict[str, Any]]]) -> None:
    for stage in stages[1:]:   # every stage that ships (demo and runtime), not the builder
        (user,) = values(stage, "USER")
        uid = user.split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root UID"
    assert values(stages[-1], "USER") == ["65532:65532"]


def test_final_stage_health_check_uses_python(stages: list[list[dict[str, Any]]]) -> None:
    (check,) = values(stages[-1], "HEALTHCHECK")
    assert "CMD" in check and '"python"' in check and "urllib.request" in check
    assert f"http://127.0.0.1:{DEFAULT_PORT}/-/healthy" in check
    assert values(stages[-1], "EXPOSE") == [str(DEFAULT_PORT)]


def test_final_stage_reads_nvml_and_never_writes(stages: list[list[dict[str, Any]]]) -> None:
    env = env_of(stages[-1])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    labels = " ".join(values(stages[-1], "LABEL"))
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert not values(stages[-1], "RUN"), "the final stage only copies the built virtualenv"
    assert any("--from=builder" in v for v in values(stages[-1], "COPY"))


def readme_install_args() -> list[str]:
    """The arguments of the README's `pip install` (its first command)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    match = re.search(r"\S*pip install ([^&#\n]*)", block)
    return shlex.split(match.group(1))


def test_image_installs_the_project_like_the_readme(stages: list[list[dict[str, Any]]]) -> None:
    args = readme_install_args()
    assert args == [".[exporter]"]
    installs = []
    for run in values(stages[0], "RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if len(words) > 2 and words[0].endswith("/pip") and words[1] == "install":
                installs.append(words[2:])
    assert installs == [args], f"builder installs {installs}, README installs {args}"


def test_entrypoint_is_the_packaged_script(stages: list[list[dict[str, Any]]]) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert values(stages[-1], "ENTRYPOINT") == ['["stepscope-exporter"]']
    assert "stepscope-exporter" in scripts


def test_dockerignore_admits_what_pip_install_needs() -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*", "start from an empty context and admit files explicitly"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], *project["project"]["license-files"]}
    links = (REPO / "stepscope").iterdir()  # the package's subpackages: links to top-level folders
    needed |= {"stepscope/", *(link.resolve().name + "/" for link in links if link.is_symlink())}
    assert {f"!{path}" for path in needed} <= set(rules)


def test_health_check_command_passes_on_a_live_exporter_and_fails_without(
    stages: list[list[dict[str, Any]]], tmp_path: Path
) -> None:
    (check,) = values(stages[-1], "HEALTHCHECK")
    argv = json.loads(check[check.index("CMD") + 3:])
    assert argv[0] == "python"
    port = free_port()
    argv = [sys.executable, *argv[1:-1], argv[-1].replace(f":{DEFAULT_PORT}/", f":{port}/")]
    with running_exporter(tmp_path, "--collectors", "", port=port):
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0


def test_the_licence_is_declared_the_pep_639_way_and_shipped() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert all((REPO / name).is_file() for name in project["license-files"])
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in (REPO / "docker" / "Dockerfile").read_text()
