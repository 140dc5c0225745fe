"""The chart's webConfig: basic auth and TLS for the exporter's port, wired into the DaemonSet (flags,
mounts, probes), the ServiceMonitor/PodMonitor (basicAuth, scheme, tlsConfig) and the helm test pod, and
run for real: the rendered args and mounted Secrets, laid out as the kubelet writes them, start a real
exporter that the monitor's credentials and CA get through and the probes reach without credentials."""

import base64
import http.client
import re
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bcrypt
import helm_python
import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml

from stepscope_testkit.processes import exporter_env, free_port, running
from tests.support.helm_chart import CHART, NAMESPACE, by_kind, exporter_container, lint, notes, objects, one, render
from tests.support.prometheus import running_prometheus_config
from tests.support.readme import doc_section

PASSWORD = "scrape-s3cret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: quick, same code path
SERVICE_DNS = f"rel-stepscope.{NAMESPACE}.svc"  # the monitors' default serverName
SECURED = {
    "webConfig": {"basicAuthUsers": {"prometheus": HASH}, "tls": {"existingSecret": "stepscope-tls"},
                  "scrapeCredentials": {"existingSecret": "stepscope-scrape"}},
    "serviceMonitor": {"enabled": True},
}


def pod_spec(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "DaemonSet")["spec"]["template"]["spec"]


def flags(objs: list[dict[str, Any]]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in exporter_container(objs)["args"] if "=" in arg)


def mounts(objs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Volume name -> (its mount in the exporter container, the volume)."""
    volumes = {v["name"]: v for v in pod_spec(objs).get("volumes", [])}
    return {m["name"]: (m, volumes[m["name"]]) for m in exporter_container(objs).get("volumeMounts", [])}


def secret_files(secret: dict[str, Any]) -> dict[str, bytes]:
    files = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
    return {**files, **{k: v.encode() for k, v in secret.get("stringData", {}).items()}}


def web_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The web config file the chart generated, as the exporter will read it."""
    secret = next(s for s in by_kind(objs, "Secret") if s["metadata"]["name"] == "rel-stepscope-web-config")
    return yaml.safe_load(secret_files(secret)["web-config.yml"])


# ---- the DaemonSet ---------------------------------------------------------------------------------

def test_off_by_default_and_basic_auth_alone(tmp_path: Path) -> None:
    """Defaults: no web config at all. Basic auth alone: the generated file holds the users and no TLS,
    the state file sits on an emptyDir, the probes stay plain HTTP and need no credentials."""
    plain = objects(render(CHART))
    assert not {"--web.config.file", "--web.auth.state-file"} & set(flags(plain))
    assert set(mounts(plain)) == {"ingest-token", "host-root"}
    objs = objects(render(CHART, {"webConfig": {"basicAuthUsers": {"prometheus": HASH}}}))
    assert web_config(objs) == {"basic_auth_users": {"prometheus": HASH}}
    assert flags(objs)["--web.config.file"] == "/etc/stepscope/web/web-config.yml"
    assert flags(objs)["--web.auth.state-file"] == "/var/lib/stepscope/auth-state.json"
    found = mounts(objs)
    assert set(found) == {"ingest-token", "host-root", "web-config", "auth-state"}
    mount, volume = found["web-config"]
    assert mount == {"name": "web-config", "mountPath": "/etc/stepscope/web", "readOnly": True}
    assert volume["secret"] == {"secretName": "rel-stepscope-web-config", "defaultMode": 0o440}  # no items
    mount, volume = found["auth-state"]
    assert mount == {"name": "auth-state", "mountPath": "/var/lib/stepscope"} and volume["emptyDir"] == {}
    for probe in ("livenessProbe", "readinessProbe"):
        assert "scheme" not in exporter_container(objs)[probe]["httpGet"]


def test_tls_serves_https_and_the_probes_follow() -> None:
    """TLS alone: the kubernetes.io/tls Secret mounted whole, its files named in the generated config,
    no state file (no basic auth), probes over HTTPS."""
    objs = objects(render(CHART, {"webConfig": {"tls": {"existingSecret": "stepscope-tls"}}}))
    assert web_config(objs) == {"tls_server_config": {"cert_file": "/etc/stepscope/tls/tls.crt",
                                                      "key_file": "/etc/stepscope/tls/tls.key"}}
    assert "--web.auth.state-file" not in flags(objs)
    mount, volume = mounts(objs)["web-tls"]
    assert mount == {"name": "web-tls", "mountPath": "/etc/stepscope/tls", "readOnly": True}
    assert volume["secret"] == {"secretName": "stepscope-tls", "defaultMode": 0o440}
    for probe, path in (("livenessProbe", "/-/healthy"), ("readinessProbe", "/-/ready")):
        assert exporter_container(objs)[probe]["httpGet"] == {"path": path, "port": "http", "scheme": "HTTPS"}
    pod = one(objects(render(CHART, SECURED), tests=True), "Pod")
    assert pod["spec"]["containers"][0]["command"][-2:] == [
        "--no-check-certificate", f"https://{SERVICE_DNS}:9847/-/healthy"]


def test_an_existing_web_config_secret_and_the_state_file_options() -> None:
    """A user's complete file: their Secret and key, nothing generated; the state file on by default
    (the chart cannot read whether the file has users), off on request, or on a node directory."""
    values = {"webConfig": {"existingSecret": "my-web", "key": "web.yml"}}
    objs = objects(render(CHART, values))
    assert [s["metadata"]["name"] for s in by_kind(objs, "Secret")] == ["rel-stepscope-ingest"]
    assert flags(objs)["--web.config.file"] == "/etc/stepscope/web/web.yml"
    assert mounts(objs)["web-config"][1]["secret"]["secretName"] == "my-web"
    assert flags(objs)["--web.auth.state-file"] == "/var/lib/stepscope/auth-state.json"
    off = objects(render(CHART, {"webConfig": {**values["webConfig"], "authStateFile": {"enabled": False}}}))
    assert "--web.auth.state-file" not in flags(off) and "auth-state" not in mounts(off)
    on_node = {"webConfig": {**values["webConfig"], "authStateFile": {"hostPath": "/var/lib/stepscope"}}}
    objs = objects(render(CHART, on_node))
    assert mounts(objs)["auth-state"][1]["hostPath"] == {"path": "/var/lib/stepscope", "type": "Directory"}


def test_no_secret_is_mounted_with_sub_path() -> None:
    """A subPath mount never sees a changed Secret: a rotated password or certificate would not arrive."""
    for name, (mount, _) in mounts(objects(render(CHART, SECURED))).items():
        assert "subPath" not in mount, name


# ---- the monitors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_monitors_send_the_credentials_and_check_the_certificate(kind: str) -> None:
    monitors = {"serviceMonitor": {"enabled": kind == "ServiceMonitor"},
                "podMonitor": {"enabled": kind == "PodMonitor"}}
    endpoint_key = "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"
    (endpoint,) = one(objects(render(CHART, {**SECURED, **monitors})), kind)["spec"][endpoint_key]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "stepscope-tls", "key": "ca.crt"}},
                                     "serverName": SERVICE_DNS}
    assert endpoint["basicAuth"] == {"username": {"name": "stepscope-scrape", "key": "username"},
                                     "password": {"name": "stepscope-scrape", "key": "password"}}
    tls = {"existingSecret": "self-signed", "caKey": "tls.crt", "serverName": "node.example",
           "insecureSkipVerify": True}
    values = {**monitors, "webConfig": {**SECURED["webConfig"], "tls": tls}}
    (endpoint,) = one(objects(render(CHART, values)), kind)["spec"][endpoint_key]
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": "self-signed", "key": "tls.crt"}},
                                     "serverName": "node.example", "insecureSkipVerify": True}
    auth_only = {**monitors, "webConfig": {"basicAuthUsers": {"p": HASH}, "scrapeCredentials": {
        "existingSecret": "s", "usernameKey": "user", "passwordKey": "pass"}}}
    (endpoint,) = one(objects(render(CHART, auth_only)), kind)["spec"][endpoint_key]
    assert "scheme" not in endpoint and "tlsConfig" not in endpoint
    assert endpoint["basicAuth"]["password"] == {"name": "s", "key": "pass"}


@pytest.mark.parametrize(("values", "message"), [
    ({"webConfig": {"existingSecret": "my-web", "basicAuthUsers": {"p": HASH}}},
     "webConfig.existingSecret and webConfig.basicAuthUsers are both set"),
    ({"webConfig": {"basicAuthUsers": {"p": HASH}}, "serviceMonitor": {"enabled": True}},
     "webConfig.scrapeCredentials.existingSecret is empty: the ServiceMonitor/PodMonitor would get 401"),
])
def test_misconfigurations_fail_clearly(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(CHART, values)


@pytest.mark.parametrize(("values", "message"), [
    ({"webConfig": {"basicAuthUsers": {"prometheus": "plaintext"}}},
     r"at '/webConfig/basicAuthUsers/prometheus': '.*' does not match"),
    ({"webConfig": {"tls": {"certFile": "/x"}}}, r"at '/webConfig/tls': additional properties 'certFile'"),
    ({"webConfig": {"tls": {"insecureSkipVerify": "yes"}}},
     r"at '/webConfig/tls/insecureSkipVerify': got string, want boolean"),
    ({"webConfig": {"authStateFile": {"hostPath": "var/lib/stepscope"}}},
     r"at '/webConfig/authStateFile/hostPath': '.*' does not match"),
    ({"webConfig": {"key": ""}}, r"at '/webConfig/key': minLength"),
    ({"webConfig": {"scrapeUsername": "prometheus"}}, r"at '/webConfig': additional properties 'scrapeUsername'"),
])
def test_schema_rejects_bad_web_config_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render(CHART, values)
    report = lint(CHART, values)
    assert any(re.search(message, m["error"]) for m in report["messages"] if m["severity"] == 3), report


# ---- the rendered pod, run for real ----------------------------------------------------------------

def make_server_cert(directory: Path) -> dict[str, bytes]:
    """A kubernetes.io/tls Secret's files as cert-manager writes them: a CA and a certificate it signed
    for the Service's DNS name only, so a client that does not send the monitor's serverName fails."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    ca, ca_key, key, csr, cert = (directory / n for n in ("ca.crt", "ca.key", "tls.key", "tls.csr", "tls.crt"))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=stepscope-test-ca",
            "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={SERVICE_DNS}", "-addext",
            f"subjectAltName=DNS:{SERVICE_DNS}", "-keyout", str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "1", "-copy_extensions", "copy", "-out", str(cert))
    return {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": ca.read_bytes()}


def kubelet_write(directory: Path, files: dict[str, bytes], generation: int) -> None:
    """A Secret volume as the kubelet's AtomicWriter lays it out and updates it: the files in a
    timestamped directory, `..data` pointing at it (swapped by rename), each name a link through it."""
    version = directory / f"..generation_{generation}"
    version.mkdir(parents=True)
    for name, content in files.items():
        (version / name).write_bytes(content)
    swap = directory / "..data_tmp"
    swap.symlink_to(version.name)
    swap.replace(directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


class Pod:
    """The rendered exporter container's mounts under a temporary root: mount path -> local directory,
    and the Secrets they come from (the chart's own, and `cluster`'s: those the user created)."""

    def __init__(self, objs: list[dict[str, Any]], cluster: dict[str, dict[str, bytes]], root: Path) -> None:
        self.places = {m["mountPath"]: root / m["mountPath"].lstrip("/") for m, _ in mounts(objs).values()}
        self.secrets = {**cluster, **{s["metadata"]["name"]: secret_files(s) for s in by_kind(objs, "Secret")}}
        self.generation = 0

    def localise(self, text: str) -> str:
        """Paths inside the pod -> paths under the root, in args and in files (the web config's cert_file)."""
        for mount_path in sorted(self.places, key=len, reverse=True):
            text = re.sub(f"{re.escape(mount_path)}(?=/|$)", str(self.places[mount_path]), text)
        return text

    def upgrade(self, objs: list[dict[str, Any]]) -> None:
        """The chart's Secrets as a new render has them, written into the running pod's volumes."""
        self.secrets.update({s["metadata"]["name"]: secret_files(s) for s in by_kind(objs, "Secret")})
        self.mount(objs)

    def mount(self, objs: list[dict[str, Any]]) -> None:
        """Writes (or, the second time, updates in place) every volume the container mounts."""
        self.generation += 1
        for mount, volume in mounts(objs).values():
            place = self.places[mount["mountPath"]]
            if "emptyDir" in volume:
                place.mkdir(parents=True, exist_ok=True)
                continue
            if "hostPath" in volume:  # the node's directory itself: this machine's
                if not place.is_symlink():
                    place.parent.mkdir(parents=True, exist_ok=True)
                    place.symlink_to(volume["hostPath"]["path"])
                continue
            files = self.secrets[volume["secret"]["secretName"]]
            if "items" in volume["secret"]:
                files = {item["path"]: files[item["key"]] for item in volume["secret"]["items"]}
            kubelet_write(place, {k: self.localise(v.decode()).encode() for k, v in files.items()}, self.generation)


def scrape_config(job: str, endpoint: dict[str, Any], cluster: dict[str, dict[str, bytes]], address: str,
                  directory: Path) -> dict[str, Any]:
    """The scrape config the Prometheus Operator makes of a monitor endpoint (its secrets as files)."""
    tls = endpoint["tlsConfig"]
    ca = directory / f"{job}-ca.crt"
    ca.write_text(secret_value(tls["ca"]["secret"], cluster))
    config = {"job_name": job, "scheme": endpoint["scheme"], "metrics_path": endpoint["path"],
              "static_configs": [{"targets": [address]}],
              "tls_config": {"ca_file": str(ca), "server_name": tls["serverName"],
                             "insecure_skip_verify": tls.get("insecureSkipVerify", False)}}
    if "basicAuth" in endpoint:
        password = directory / f"{job}-password"
        password.write_text(secret_value(endpoint["basicAuth"]["password"], cluster))
        config["basic_auth"] = {"username": secret_value(endpoint["basicAuth"]["username"], cluster),
                                "password_file": str(password)}
    return config


def prometheus_scrapes(endpoint: dict[str, Any], cluster: dict[str, dict[str, bytes]], address: str,
                       tmp_path: Path) -> dict[str, tuple[str, str]]:
    """A real Prometheus scrapes `address` as the monitor endpoint says ("monitor") and the same
    without its basicAuth ("anonymous"): job -> (health, last error) once both were scraped."""
    directory = tmp_path / "prometheus"
    directory.mkdir()
    anonymous = {k: v for k, v in endpoint.items() if k != "basicAuth"}
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        scrape_config("monitor", endpoint, cluster, address, directory),
        scrape_config("anonymous", anonymous, cluster, address, directory)]}
    with running_prometheus_config(directory, config) as prometheus:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            targets = requests.get(f"{prometheus.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            found = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets if t["health"] != "unknown"}
            if len(found) == 2:
                return found
            time.sleep(0.2)
    raise AssertionError(f"Prometheus did not scrape both jobs in 30 s\n{prometheus.log()}")


def wait_for_status(get: Callable[[], int], wanted: int, timeout: float = 15.0) -> bool:
    """Whether `get` answers `wanted` within `timeout` (the exporter looks at its web config each second)."""
    deadline = time.monotonic() + timeout
    while get() != wanted:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def local_args(objs: list[dict[str, Any]], pod: Pod, port: int) -> list[str]:
    """The container's args with the pod's paths under its root, on a loopback port, no collectors."""
    local = {"--web.listen-address": f"127.0.0.1:{port}", "--collectors": ""}
    return [f"{arg.split('=', 1)[0]}={local[arg.split('=', 1)[0]]}" if arg.split("=", 1)[0] in local
            else pod.localise(arg) for arg in exporter_container(objs)["args"]]


def secret_value(ref: dict[str, str], cluster: dict[str, dict[str, bytes]]) -> str:
    """A monitor's secret reference ({name, key}) read from the cluster's Secrets."""
    return cluster[ref["name"]][ref["key"]].decode()


def https_get(port: int, path: str, context: ssl.SSLContext, server_name: str,
              auth: tuple[str, str] | None = None) -> tuple[int, str]:
    """GET over TLS to 127.0.0.1:port, sending `server_name` as SNI and checking the certificate for it,
    as Prometheus does with a tlsConfig.serverName."""
    headers = {"Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()} if auth else {}
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection = http.client.HTTPConnection(server_name, port, timeout=10)
    try:
        connection.sock = context.wrap_socket(raw, server_hostname=server_name)
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()
        raw.close()


def scraper_context(endpoint: dict[str, Any], cluster: dict[str, dict[str, bytes]]) -> ssl.SSLContext:
    """What Prometheus builds from the monitor's tlsConfig: the CA it names, hostname checked."""
    return ssl.create_default_context(cadata=secret_value(endpoint["tlsConfig"]["ca"]["secret"], cluster))


def probe_context() -> ssl.SSLContext:
    """The kubelet's HTTPS probes check no certificate."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def test_the_rendered_pod_runs_a_real_exporter_the_monitor_scrapes_and_the_probes_reach(tmp_path: Path) -> None:
    """The DaemonSet's args and mounts, the generated web config and ingest Secrets, and the Secrets a
    user creates (TLS from a CA, the scraper's credentials) start a real exporter. Unauthenticated
    /metrics is 401, the ServiceMonitor's credentials, CA and serverName get 200 (a real Prometheus with
    the scrape config the operator makes of it: up; without the credentials: 401), the probes get 200 over
    HTTPS without credentials, the state file records the scraper, and a rotated password reaches the
    running exporter through the directory mount (the kubelet's ..data swap)."""
    cluster = {"stepscope-tls": make_server_cert(tmp_path),
               "stepscope-scrape": {"username": b"prometheus", "password": PASSWORD.encode()}}
    objs = objects(render(CHART, SECURED))
    pod = Pod(objs, cluster, tmp_path / "pod")
    pod.mount(objs)
    port = free_port()
    (endpoint,) = one(objs, "ServiceMonitor")["spec"]["endpoints"]
    user, password = (secret_value(endpoint["basicAuth"][part], cluster) for part in ("username", "password"))
    scraper, server_name = scraper_context(endpoint, cluster), endpoint["tlsConfig"]["serverName"]
    with running([sys.executable, "-m", "stepscope.exporter", *local_args(objs, pod, port)],
                 f"https://127.0.0.1:{port}/-/ready",
                 tmp_path / "exporter.log", env=exporter_env(), verify=False) as exporter:
        assert https_get(port, "/metrics", scraper, server_name)[0] == 401
        assert https_get(port, "/metrics", scraper, server_name, (user, "wrong"))[0] == 401
        status, body = https_get(port, "/metrics", scraper, server_name, (user, password))
        assert status == 200 and "stepscope_exporter_build_info" in body
        for probe in ("livenessProbe", "readinessProbe"):
            get = exporter_container(objs)[probe]["httpGet"]
            assert get["scheme"] == "HTTPS"
            assert https_get(port, get["path"], probe_context(), "127.0.0.1")[0] == 200, probe
        with pytest.raises(ssl.SSLCertVerificationError):  # the certificate names the Service, not the IP
            https_get(port, "/metrics", scraper, "127.0.0.1", (user, password))
        assert prometheus_scrapes(endpoint, cluster, f"127.0.0.1:{port}", tmp_path) == {
            "monitor": ("up", ""), "anonymous": ("down", "server returned HTTP status 401 Unauthorized")}
        state = pod.places["/var/lib/stepscope"] / "auth-state.json"
        assert "127.0.0.1" in state.read_text()

        rotated = "rotated-s3cret"
        values = {**SECURED, "webConfig": {**SECURED["webConfig"], "basicAuthUsers": {
            "prometheus": bcrypt.hashpw(rotated.encode(), bcrypt.gensalt(4)).decode()}}}
        pod.upgrade(objects(render(CHART, values)))  # helm upgrade: the Secret changes, the pod stays
        assert wait_for_status(lambda: https_get(port, "/metrics", scraper, server_name, (user, rotated))[0], 200), \
            exporter.log()
        assert https_get(port, "/metrics", scraper, server_name, (user, password))[0] == 401
    assert "Traceback" not in exporter.log()


def test_notes_say_how_to_reach_a_secured_exporter() -> None:
    text = notes(render(CHART, SECURED))
    assert "curl -sk -u USER:PASSWORD https://localhost:9847/metrics" in text
    assert 'value: "https://$(HOST_IP):9847"' in text and "REQUESTS_CA_BUNDLE" in text
    assert "curl -s http://localhost:9847/metrics" in notes(render(CHART))


def test_validates_against_kubernetes() -> None:
    """kubernetes-validate on the objects of the hostPath and TLS variants (the ci values file covers
    the rest in tests/test_helm_chart.py)."""
    values = {"webConfig": {"existingSecret": "w", "tls": {"existingSecret": "t"},
                            "authStateFile": {"hostPath": "/var/lib/stepscope"}}}
    for obj in objects(render(CHART, values)) + objects(render(CHART, values), tests=True):
        try:
            kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{obj['kind']} at {'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_documented_values_are_the_ci_values_and_hash_their_password() -> None:
    """docs/deployment.md's webConfig block is what the ci values file lints and validates (through
    tests/test_helm_chart.py), and its hash is of the password its kubectl command stores."""
    (block,) = re.findall(r"```yaml\n(.*?)```", doc_section("chart-web-config"), re.S)
    documented = yaml.safe_load(block)["webConfig"]
    assert documented == yaml.safe_load((CHART / "ci" / "web-security-values.yaml").read_text())["webConfig"]
    password = re.search(r"--from-literal=password=(\S+)", doc_section("deployment")).group(1)
    assert bcrypt.checkpw(password.encode(), documented["basicAuthUsers"]["prometheus"].encode())
