"""Tracker settings from arguments and the environment, validated once at start-up (never on the hot path)."""

from __future__ import annotations

import itertools
import math
import os
import pwd
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from stepscope.contract.peak_flops import DEFAULT_DTYPE, DTYPES
from stepscope.contract.thresholds import THRESHOLDS
from stepscope.contract.training import RUN_NAME_RULE, is_run_name

DEFAULT_PUSH_URL = "http://127.0.0.1:9847"
DEFAULT_PUSH_INTERVAL = 5.0
DEFAULT_MAX_PHASES = 32
MAX_LABEL_LENGTH = 128
# The longest push interval, backoff and push timeout: the exporter forgets a group not pushed for its
# --ingest-ttl (600 s by default), so a rank pushing less often comes and goes. Far above, a wait the pusher
# thread cannot make (threading.TIMEOUT_MAX) killed it with OverflowError: no periodic push at all. The rules
# assume it plus the scrape interval stays under rank_lost_seconds, 45 s (StepscopeRankLost, docs/alerts.md).
MAX_PUSH_SECONDS = 600.0
# Pushing more often than this is no finer reading (Prometheus scrapes every few seconds) and, at 1e-9, a pusher
# thread pushing flat out: a core of the training node and the node's exporter spent on it.
MIN_PUSH_INTERVAL = 0.01
# The longest wait between tries after a timeout or a 5xx: a third of the silence after which StepscopeRankLost pages a
# rank that did not close (rank_lost_seconds, 45 s), so that a rank pushes again within 15 s of its exporter's
# recovery. At 60 s, waits of 10, 20 and 40 s after an exporter answered 503 for 40 s kept a rank that trained on
# unpushed for 75 s: StepscopeRankLost paged it from 71 to 86 s, though both were fine again at 52 s.
DEFAULT_MAX_BACKOFF = THRESHOLDS["rank_lost_seconds"].value / 3


# Profiler traces (stepscope.hooks.profiling): where they go, the most one may take compressed, and how
# many of a rank's traces are kept (older ones are deleted).
def _user_trace_dir() -> str:
    """`$TMPDIR/stepscope-traces-<user>`: one per user, as the first process to make a shared one owns it (mode
    0755), and on a node of several users (Slurm) every other user's trace requests failed, permission denied.
    Named by the process's uid, not $USER (which `su` and containers keep from another user), and by the uid
    itself where it has no name (a container's arbitrary uid)."""
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return os.path.join(tempfile.gettempdir(), f"stepscope-traces-{user}")


DEFAULT_TRACE_DIR = _user_trace_dir()
DEFAULT_TRACE_MAX_BYTES = 200 * 1024 * 1024
DEFAULT_TRACE_KEEP = 5

# The environment variable of each setting it can come from (Config.resolve; errors name it).
ENVIRONMENT: Mapping[str, str] = {
    "run": "STEPSCOPE_RUN", "rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE",
    "push_url": "STEPSCOPE_PUSH_URL", "push_token": "STEPSCOPE_PUSH_TOKEN",
    "push_interval": "STEPSCOPE_PUSH_INTERVAL", "buckets": "STEPSCOPE_BUCKETS",
    "phase_buckets": "STEPSCOPE_PHASE_BUCKETS", "share_bounds": "STEPSCOPE_SHARE_BOUNDS",
    "trace_dir": "STEPSCOPE_TRACE_DIR", "trace_max_bytes": "STEPSCOPE_TRACE_MAX_BYTES",
    "trace_keep": "STEPSCOPE_TRACE_KEEP", "flops_dtype": "STEPSCOPE_FLOPS_DTYPE", "peak_flops": "STEPSCOPE_PEAK_FLOPS",
}

# Launchers that start each rank without torch's variables, as (launcher, rank, local rank, world size variables),
# read where RANK, LOCAL_RANK and WORLD_SIZE are all unset. Under srun without torchrun every rank was rank 0 of 1:
# two srun tasks on one node resolved run 'train' rank 0, and one was refused (409) at each of its 17 pushes, its
# steps never stored. MPI's come first: mpirun inside a Slurm batch script also sees the batch step's SLURM_PROCID 0.
# srun's SLURM_STEP_NUM_TASKS is its step's task count; SLURM_NTASKS is also set in a batch script, where it counts
# the tasks the job may start, not the processes that run.
LAUNCHER_RANKS: tuple[tuple[str, str, str, str], ...] = (
    ("Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MPICH's or Intel MPI's mpiexec", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("Slurm's srun", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS"),
)
TORCH_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
NODE_RANK_VARIABLE = "NODE_RANK"  # Lightning's launcher's node (`_rank_variables`)
# The script of a Ray worker process (`_in_ray_worker`), whose name is no run's.
RAY_WORKER_SCRIPT = ("ray", "_private", "workers", "default_worker.py")
RAY_JOB_VARIABLE = "RAY_JOB_ID"  # what Ray sets in its workers; names the run outside Ray Train (`_ray_run`)
# Slurm's job (and job array) ids, which a default run name carries (`_default_run`).
SLURM_JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
# What Kubeflow's controllers set in every training container that names the job, not the pod (`_kubeflow_job`):
# Trainer v2's torch runtime PET_MASTER_ADDR `<TrainJob>-node-0-0.<TrainJob>` (kubeflow/trainer, torch plugin); the
# training-operator v1 PyTorchJob MASTER_ADDR `<PyTorchJob>-master-0` with a master replica, or PET_RDZV_ENDPOINT
# `<PyTorchJob>-worker-0:<port>` with an elastic policy, in pods whose HOSTNAME (the pod's name) is
# `<PyTorchJob>-master-0` or `<PyTorchJob>-worker-<i>`. JobSet and Indexed Jobs set none.
KUBEFLOW_JOB_VARIABLES = ("PET_MASTER_ADDR", "MASTER_ADDR", "PET_RDZV_ENDPOINT", "HOSTNAME")
_TRAINJOB_MASTER = re.compile(r"(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-node-0-0\.(?P=job)")
_PYTORCHJOB_FIRST_POD = (("MASTER_ADDR", re.compile(r"(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-master-0")),
                         ("PET_RDZV_ENDPOINT", re.compile(r"(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-worker-0:[0-9]+")))

_PHASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_ASCII_DIGITS = re.compile(r"[0-9]+")


def bracket_ipv6_host(url: str) -> str:
    """`url` with brackets around an IPv6 host written without them before its port: the chart's
    `http://$(HOST_IP):9847` is `http://fd00::5:9847` on an IPv6 node, which no HTTP client takes (every push
    failed with InvalidURL), and Kubernetes cannot add the brackets itself. Any other unbracketed host of more
    than one colon raises ValueError saying how to write it."""
    scheme, separator, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, host_port = authority.rpartition("@")
    if host_port.startswith("[") or host_port.count(":") < 2:
        return url
    import ipaddress  # only for a URL that needs it: the hooks keep their imports few

    host, _, port = host_port.rpartition(":")
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError("has a host with colons: write an IPv6 address in brackets, with a port "
                         "(http://[fd00::5]:9847)") from None
    if not port.isdigit():
        raise ValueError(f"has {port!r} where the port goes: write an IPv6 address in brackets (http://[{host}]:9847)")
    return f"{scheme}{separator}{userinfo}{at}[{host}]:{port}{slash}{path}"


def _check_base_url(url: str) -> None:
    """ValueError where `url` is no base the group's path can be appended to, as written: one with a query or a
    fragment (`http://host:9847?x=1` pushed to `http://host:9847?x=1/metrics/job/...`, the exporter's `/`: 405 at
    every push of the run, training unseen), or one that already ends in the push API's `/metrics` (the scrape
    URL, `http://host:9847/metrics`, pushed to `/metrics/metrics/job/...`: 404 at every push)."""
    if "?" in url or "#" in url:
        raise ValueError("must not have a query (?...) or a fragment (#...): the push path is appended to it")
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/metrics") or "/metrics/job/" in f"{path}/":
        raise ValueError("must be the exporter's base URL, without /metrics: the push path /metrics/job/... is "
                         "appended to it")


def _port(url: str) -> int | None:
    """`url`'s port; ValueError where it is not a number from 0 to 65535: requests refuses every push to it
    (InvalidURL), which init took and the pusher retried for the whole run."""
    try:
        return urlsplit(url).port
    except ValueError:
        raise ValueError("has a port that is not a number from 0 to 65535") from None


def log_buckets(low: float, high: float, count: int) -> tuple[float, ...]:
    """`count` log-spaced upper bounds from low to high, rounded to 2 significant digits (readable `le`)."""
    if not (0 < low < high and count >= 2):
        raise ValueError(f"log_buckets needs 0 < low < high and count >= 2, got {low}, {high}, {count}")
    ratio = (high / low) ** (1 / (count - 1))
    bounds = tuple(float(f"{low * ratio**i:.2g}") for i in range(count))
    return validate_buckets(bounds)


def validate_buckets(bounds: Sequence[float], name: str = "buckets") -> tuple[float, ...]:
    """Finite, positive, strictly increasing upper bounds (the +Inf bucket is implicit); errors say `name`."""
    values = tuple(float(b) for b in bounds)
    if not values:
        raise ValueError(f"{name} must not be empty")
    for value in values:
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and > 0 (+Inf is implicit), got {value!r}")
    for lower, upper in itertools.pairwise(values):
        if upper <= lower:
            raise ValueError(f"{name} must be strictly increasing, got {lower!r} then {upper!r}")
    return values



def validate_phase_name(name: str) -> str:
    if not isinstance(name, str) or not _PHASE_NAME.match(name):
        raise ValueError(f"phase name must match [A-Za-z_][A-Za-z0-9_]* (at most 64 chars), got {name!r}")
    return name


def _ascii_float(text: str) -> float:
    """`text` as float() reads it, where it is written in ASCII without `_`: float() also takes `1_0` (10) and other
    scripts' digits (Arabic-Indic five, U+0665, as 5), which no one writes meaning a number of seconds or a bound."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"not an ASCII number: {text!r}")
    return float(text)


def _int_env(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    """The variable's whole number, written in ASCII digits (blanks around them ignored; blank is unset). int() took
    `RANK=1_0` as rank 10, `+1` as 1 and an Arabic-Indic one (U+0661) as 1: a rank pushed as one it is not."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    digits = raw.strip()
    if not _ASCII_DIGITS.fullmatch(digits) or int(digits) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} in ASCII digits, got {raw!r}")
    return int(digits)


def _float_env(env: Mapping[str, str], name: str, what: str) -> float:
    raw = env[name]
    try:
        return _ascii_float(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None


def _bool_env(env: Mapping[str, str], name: str) -> bool:
    raw = env[name].strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be one of 1, true, yes, on, 0, false, no, off; got {env[name]!r}")


def sent_token(value: str) -> str:
    """The token a client sends from STEPSCOPE_PUSH_TOKEN: its first non-blank line, stripped. During a
    rotation the exporter's Secret lists the new token above the old (exporter.ingest.tokens), and pods
    started then take the new one from the same Secret."""
    return next((line.strip() for line in value.splitlines() if line.strip()), "")


def _check_token(token: str, name: str) -> None:
    """ValueError naming the first character an HTTP header cannot carry (Latin-1 text without control
    characters, as the exporter's own check): every push would fail with it, and training would go unseen."""
    for character in token:
        if not (character == "\t" or " " <= character <= "~" or "\xa0" <= character <= "\xff"):
            raise ValueError(f"{name} holds {character!r} (U+{ord(character):04X}), which an HTTP header cannot "
                             "carry: use printable ASCII")


def _is_whole(value: object) -> bool:
    """An int that is not a bool: True is an int to Python, and rank=True pushed to .../rank/True, which the exporter
    refuses (400 at every push of the run)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def default_run_origin(source: str) -> str:
    """How errors and the init log name a run the user never named: `python "it's.py"` was told "run must be ...",
    an argument it never passed, and a script of 140 characters "run must be at most 128 characters, got 140"."""
    return f"the run, {source} by default (name it with STEPSCOPE_RUN or init(run=...)),"


SCRIPT_NAME_RUN = default_run_origin("the script's name")


def _in_ipython_kernel() -> bool:
    """A Jupyter (or VS Code, Colab) kernel: ipykernel is loaded and `__main__` is its namespace, not a file. There
    sys.argv[0] is the kernel's launcher, so every notebook was run `ipykernel_launcher`: two on one node took turns
    being refused (409), and notebooks on two nodes raised StepscopeRunNameClash against each other."""
    return "ipykernel" in sys.modules and not hasattr(sys.modules.get("__main__"), "__file__")


def _notebook_run(env: Mapping[str, str]) -> tuple[str, str]:
    """The notebook's file name without `.ipynb`, where the kernel knows it (Jupyter's server sets JPY_SESSION_NAME
    to its path, VS Code `__vsc_ipynb_file__` in its namespace), else `notebook-<pid>`: one per kernel."""
    path = env.get("JPY_SESSION_NAME") or getattr(sys.modules.get("__main__"), "__vsc_ipynb_file__", "")
    if isinstance(path, str) and Path(path).stem:
        return Path(path).stem, default_run_origin("the notebook's name")
    return f"notebook-{os.getpid()}", default_run_origin("a kernel's notebook-<pid>")


def _in_ray_worker() -> bool:
    """A Ray worker process, where Ray Train runs the training function: its script is Ray's
    `ray/_private/workers/default_worker.py`, so every Ray Train run on a cluster was run `default_worker` (a
    TorchTrainer of 2 workers on Ray 2.60 pushed run 'default_worker' ranks 0 and 1), and two on one node clashed."""
    return bool(sys.argv) and Path(sys.argv[0]).parts[-4:] == RAY_WORKER_SCRIPT


def _ray_run(env: Mapping[str, str]) -> tuple[str, str]:
    """Ray Train's run name, shared by the run's workers and new at each fit(): `RunConfig(name=...)`, else Ray's
    `ray_train_run-<date>_<time>`; outside Ray Train (a plain Ray task or actor), `ray-job-<RAY_JOB_ID>`. Ray is read
    only as the worker has imported it: the hooks import no framework."""
    train = sys.modules.get("ray.train")
    name = None
    if train is not None:
        try:
            name = train.get_context().get_experiment_name()
        except Exception:  # no Train context in this worker, or a Ray without it: the job's id then
            name = None
    if isinstance(name, str) and name.strip():
        return name.strip(), default_run_origin("Ray Train's run name")
    return f"ray-job-{env.get(RAY_JOB_VARIABLE, '').strip() or 'unknown'}", default_run_origin("Ray's job id")


def _default_run(env: Mapping[str, str]) -> tuple[str, str]:
    """The run and how errors name it. In a script, the script's name: `train` for `python train.py` and `python -m
    jobs.train`. A package run with `-m` is named by its folder (`python -m jobs` runs jobs/__main__.py: every such
    job would be run `__main__`), and code with no file (`-c`, stdin's `-`, the REPL) is `default`. In a notebook's
    kernel, the notebook's name (`_notebook_run`); in a Ray worker, Ray Train's run (`_ray_run`). Under Slurm or in a
    Kubeflow job, the job follows it (`_with_job`)."""
    if _in_ipython_kernel():
        return _with_job(env, *_notebook_run(env))
    if _in_ray_worker():
        return _ray_run(env)
    if not sys.argv or sys.argv[0] in ("", "-c", "-m", "-"):
        return _with_job(env, "default", SCRIPT_NAME_RUN)
    script = Path(sys.argv[0])
    named = (script.parent.name if script.stem == "__main__" else script.stem) or "default"
    return _with_job(env, named, SCRIPT_NAME_RUN)


def _slurm_job(env: Mapping[str, str]) -> str:
    """The Slurm job this process belongs to as Slurm writes it (`%A_%a` for an array's task, else `%j`), or "":
    two jobs, or two tasks of an array, of one script on a node were both run `train`, and the second was refused
    (409) at each of its pushes while the first ran."""
    array_job, task = env.get("SLURM_ARRAY_JOB_ID", "").strip(), env.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID", "").strip()


def _kubeflow_job(env: Mapping[str, str]) -> tuple[str, str]:
    """The Kubeflow job this process belongs to and what it is, or ("", ""): two TrainJobs or PyTorchJobs of one
    image on a node were both run `train`, and the second's pushes were refused (409) while the first ran. Read only
    where the controller's address of the job's first pod matches its pattern and, for a PyTorchJob, this pod's name
    is one of that job's: a script's own MASTER_ADDR (a Slurm node's, 127.0.0.1, torchrun's) names no job."""
    trainjob = _TRAINJOB_MASTER.fullmatch(env.get("PET_MASTER_ADDR", "").strip())
    if trainjob:
        return trainjob["job"], "the Kubeflow TrainJob's name"
    for variable, first_pod in _PYTORCHJOB_FIRST_POD:
        pytorchjob = first_pod.fullmatch(env.get(variable, "").strip())
        if pytorchjob and re.fullmatch(rf"{re.escape(pytorchjob['job'])}-(master-0|worker-[0-9]+)",
                                       env.get("HOSTNAME", "").strip()):
            return pytorchjob["job"], "the PyTorchJob's name"
    return "", ""


def _with_job(env: Mapping[str, str], run: str, origin: str) -> tuple[str, str]:
    """`run`-<Slurm job> under Slurm, else `run`-<Kubeflow job> in a TrainJob's or PyTorchJob's pod (one run per job,
    shared by all its ranks on all its nodes), else `run`."""
    job, what = _slurm_job(env), "the Slurm job's id"
    if not job:
        job, what = _kubeflow_job(env)
    if not job:
        return run, origin
    return f"{run}-{job}", origin.replace(" by default", f" and {what} by default", 1)


@dataclass(frozen=True)
class Config:
    """Everything a Tracker needs; build it with `Config.resolve` so the environment fills the gaps."""

    run: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    push_url: str = DEFAULT_PUSH_URL  # "" disables pushing
    push_token: str | None = None
    push_interval: float = DEFAULT_PUSH_INTERVAL
    push_timeout: float = 2.0
    max_backoff: float = DEFAULT_MAX_BACKOFF
    buckets: tuple[float, ...] | None = None  # None: buckets that follow the run (stepscope.hooks.timing)
    phase_buckets: bool = False  # per-phase buckets; phases always have _sum and _count
    share_bounds: bool = True  # agree on bucket bounds with the run's other ranks (stepscope.hooks.run_bounds)
    max_phases: int = DEFAULT_MAX_PHASES
    framework: str = "pytorch"
    sync: bool = False
    handle_sigterm: bool = True  # push the final state on SIGTERM, then chain (stepscope.hooks.signals)
    trace_dir: str = DEFAULT_TRACE_DIR
    trace_max_bytes: int = DEFAULT_TRACE_MAX_BYTES
    trace_keep: int = DEFAULT_TRACE_KEEP
    # Model FLOPs (docs/mfu.md): stated per step and/or per sample, the dtype they run in, and the GPU's dense
    # peak FLOP/s where the table's does not fit (None: the table's, by the GPU's NVML name).
    flops_per_step: float = 0
    flops_per_sample: float = 0
    flops_dtype: str = DEFAULT_DTYPE
    peak_flops: float | None = None
    # Setting -> (environment variable, its text) for each value `resolve` took from the environment (or, for the
    # run, from the script's name), so that an error names what the user set, not an argument they never passed.
    from_env: Mapping[str, tuple[str, str]] = field(default_factory=dict, compare=False, repr=False)

    def _named(self, setting: str) -> str:
        """How errors name `setting`: its environment variable where the value came from one."""
        return self.from_env[setting][0] if setting in self.from_env else setting

    def _shown(self, setting: str) -> str:
        """How errors show the value of `setting`: the variable's text as set, or the argument's repr."""
        return repr(self.from_env[setting][1]) if setting in self.from_env else repr(getattr(self, setting))

    def _invalid(self, setting: str, must: str) -> ValueError:
        return ValueError(f"{self._named(setting)} must be {must}, got {self._shown(setting)}")

    def __post_init__(self) -> None:
        if not isinstance(self.run, str) or not self.run.strip():
            raise self._invalid("run", "a non-empty string")
        if not is_run_name(self.run):  # a tab, a newline, a quote: the exporter would refuse every push
            raise self._invalid("run", f"{RUN_NAME_RULE}: no tab, newline or control character, and no quote, "
                                       "which Grafana's dashboards cannot select")
        if self.run != self.run.strip():  # Grafana's run list shows "trail " and "trail" alike: two runs, one name
            raise self._invalid("run", "a name without blanks at its start or end, which Grafana's run list does not "
                                       "show")
        if len(self.run) > MAX_LABEL_LENGTH:
            raise ValueError(f"{self._named('run')} must be at most {MAX_LABEL_LENGTH} characters, got "
                             f"{len(self.run)}")
        for name in ("rank", "local_rank"):
            value = getattr(self, name)
            if not _is_whole(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not _is_whole(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if self.rank >= self.world_size:
            raise ValueError(f"{self._named('rank')} {self.rank} must be smaller than {self._named('world_size')} "
                             f"{self.world_size}")
        if self.push_url and not re.match(r"^https?://[^/\s]+", self.push_url):
            raise ValueError(f"{self._named('push_url')} must start with http:// or https:// and a host (empty "
                             f"disables pushing), got {self._shown('push_url')}")
        if self.push_url:
            try:
                _check_base_url(self.push_url)
                object.__setattr__(self, "push_url", bracket_ipv6_host(self.push_url))
                _port(self.push_url)
            except ValueError as exc:
                raise ValueError(f"{self._named('push_url')} {exc}, got {self._shown('push_url')}") from None
        if self.push_token is not None:
            _check_token(self.push_token, self._named("push_token"))
        for name in ("push_interval", "push_timeout", "max_backoff"):
            value = getattr(self, name)
            least = MIN_PUSH_INTERVAL if name == "push_interval" else 0
            if not _is_number(value) or not least < value <= MAX_PUSH_SECONDS:
                raise self._invalid(name, f"a number > {least:g} and at most {MAX_PUSH_SECONDS:g} seconds (the "
                                    "exporter's default --ingest-ttl)")
        if self.buckets is not None:
            object.__setattr__(self, "buckets", validate_buckets(self.buckets, self._named("buckets")))
        for name in ("phase_buckets", "share_bounds"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_whole(self.max_phases) or self.max_phases < 1:
            raise ValueError(f"max_phases must be an integer >= 1, got {self.max_phases!r}")
        if not self.framework or len(self.framework) > MAX_LABEL_LENGTH:
            raise ValueError(f"framework must be a short non-empty string, got {self.framework!r}")
        if not isinstance(self.trace_dir, str) or not self.trace_dir.strip():
            raise ValueError(f"trace_dir must be a directory path (STEPSCOPE_TRACE_DIR), got {self.trace_dir!r}")
        object.__setattr__(self, "trace_dir", os.path.abspath(os.path.expanduser(self.trace_dir.strip())))
        for name, minimum in (("trace_max_bytes", 1024), ("trace_keep", 1)):
            value = getattr(self, name)
            if not _is_whole(value) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        self._validate_flops()

    def _validate_flops(self) -> None:
        for name in ("flops_per_step", "flops_per_sample"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0 (FLOPs), got {value!r}")
        if self.flops_dtype not in DTYPES:
            raise self._invalid("flops_dtype", f"one of {', '.join(DTYPES)}")
        if self.peak_flops is not None and not (_is_number(self.peak_flops) and self.peak_flops > 0):
            raise self._invalid("peak_flops", "a number > 0 (FLOP/s of one GPU)")

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **given: object) -> Config:
        """Arguments win; None means "take it from the environment (or the default)".

        Environment: STEPSCOPE_RUN, RANK, LOCAL_RANK, WORLD_SIZE (as set by torchrun; else a launcher's own,
        LAUNCHER_RANKS), STEPSCOPE_PUSH_URL,
        STEPSCOPE_PUSH_TOKEN, STEPSCOPE_PUSH_INTERVAL, STEPSCOPE_BUCKETS (comma-separated seconds),
        STEPSCOPE_PHASE_BUCKETS and STEPSCOPE_SHARE_BOUNDS (1/true/yes/on or 0/false/no/off), STEPSCOPE_TRACE_DIR,
        STEPSCOPE_TRACE_MAX_BYTES, STEPSCOPE_TRACE_KEEP, STEPSCOPE_FLOPS_DTYPE, STEPSCOPE_PEAK_FLOPS.
        """
        env = os.environ if env is None else env
        values = {k: v for k, v in given.items() if v is not None}
        from_env = {setting: (variable, env[variable]) for setting, variable in ENVIRONMENT.items()
                    if setting not in values and env.get(variable)}
        if "run" not in values:
            if not env.get("STEPSCOPE_RUN"):
                values["run"], origin = _default_run(env)
                from_env["run"] = (origin, values["run"])
            else:
                values["run"] = env["STEPSCOPE_RUN"]
        _resolve_ranks(env, values, from_env)
        if "push_url" not in values:
            values["push_url"] = env.get("STEPSCOPE_PUSH_URL", DEFAULT_PUSH_URL).strip()
        values["push_url"] = str(values["push_url"]).rstrip("/")
        if "push_token" not in values and env.get("STEPSCOPE_PUSH_TOKEN"):
            values["push_token"] = sent_token(env["STEPSCOPE_PUSH_TOKEN"])
        if "push_interval" not in values and env.get("STEPSCOPE_PUSH_INTERVAL"):
            values["push_interval"] = _float_env(env, "STEPSCOPE_PUSH_INTERVAL", "a number of seconds")
        if "buckets" not in values and env.get("STEPSCOPE_BUCKETS"):
            raw = env["STEPSCOPE_BUCKETS"]
            try:
                values["buckets"] = tuple(_ascii_float(part) for part in raw.split(","))
            except ValueError:
                raise ValueError(f"STEPSCOPE_BUCKETS must be comma-separated seconds, got {raw!r}") from None
        for name in ("phase_buckets", "share_bounds"):
            if name not in values and env.get(f"STEPSCOPE_{name.upper()}", "").strip():
                values[name] = _bool_env(env, f"STEPSCOPE_{name.upper()}")
        if "trace_dir" not in values and env.get("STEPSCOPE_TRACE_DIR", "").strip():
            values["trace_dir"] = env["STEPSCOPE_TRACE_DIR"]
        values.setdefault("trace_max_bytes", _int_env(env, "STEPSCOPE_TRACE_MAX_BYTES", DEFAULT_TRACE_MAX_BYTES, 1024))
        values.setdefault("trace_keep", _int_env(env, "STEPSCOPE_TRACE_KEEP", DEFAULT_TRACE_KEEP, 1))
        if "flops_dtype" not in values and env.get("STEPSCOPE_FLOPS_DTYPE", "").strip():
            values["flops_dtype"] = env["STEPSCOPE_FLOPS_DTYPE"].strip()
        if "peak_flops" not in values and env.get("STEPSCOPE_PEAK_FLOPS", "").strip():
            values["peak_flops"] = _float_env(env, "STEPSCOPE_PEAK_FLOPS", "FLOP/s (a number like 989.4e12)")
        return cls(**values, from_env=from_env)  # type: ignore[arg-type]


def _is_set(env: Mapping[str, str], name: str) -> bool:
    return bool(env.get(name, "").strip())


def _rank_variables(env: Mapping[str, str]) -> tuple[str, str, str]:
    """The (rank, local rank, world size) variables to read: torch's where any is set (torchrun, accelerate, DeepSpeed,
    Ray Train and Kubeflow's PyTorchJob set them), else those of the first launcher of LAUNCHER_RANKS whose world size
    is set. Not a mix, as torchrun inside srun has rank 9 of 16 in RANK and WORLD_SIZE, and srun's 2 tasks (one
    torchrun per node) in SLURM_STEP_NUM_TASKS; but for WORLD_SIZE exported to the whole job without RANK (batch
    scripts that set it and MASTER_ADDR for init_process_group, and read the rank from SLURM_PROCID in Python), the
    rank of the launcher whose world size is the same number: both srun tasks of such a job were rank 0 of 2, and one
    was refused (409) at each push. Lightning's own launcher (Trainer(strategy="ddp") without torchrun) sets
    WORLD_SIZE, LOCAL_RANK and NODE_RANK but no RANK, its global rank NODE_RANK x devices + LOCAL_RANK: on its first
    node (NODE_RANK 0 or unset) the local rank is the rank; past it the devices per node are in no variable."""
    if not any(_is_set(env, name) for name in TORCH_RANK_VARIABLES):
        for _, rank, local_rank, world_size in LAUNCHER_RANKS:
            if _is_set(env, world_size):
                return rank, local_rank, world_size
        return TORCH_RANK_VARIABLES
    if _is_set(env, "RANK") or not _is_set(env, "WORLD_SIZE"):
        return TORCH_RANK_VARIABLES
    for _, rank, local_rank, world_size in LAUNCHER_RANKS:
        if env.get(world_size, "").strip() == env["WORLD_SIZE"].strip():
            return rank, "LOCAL_RANK" if _is_set(env, "LOCAL_RANK") else local_rank, "WORLD_SIZE"
    if _is_set(env, "LOCAL_RANK") and env.get(NODE_RANK_VARIABLE, "0").strip() in ("", "0"):
        return "LOCAL_RANK", "LOCAL_RANK", "WORLD_SIZE"
    return TORCH_RANK_VARIABLES


def _resolve_ranks(env: Mapping[str, str], values: dict[str, object], from_env: dict[str, tuple[str, str]]) -> None:
    """Fills rank, local_rank and world_size not given from the variables `_rank_variables` picks, and records which
    variable each came from, so that errors name it. A rank set without its world size, or a world size of more than
    one without its rank, raises naming both: `RANK=1` alone was told "RANK 1 must be smaller than world_size 1", a
    setting the user never made, and `WORLD_SIZE=2` alone made every process rank 0."""
    variables = _rank_variables(env)
    given = {setting for setting in ("rank", "world_size") if setting in values}
    for setting, variable, default in zip(("rank", "local_rank", "world_size"), variables, (0, 0, 1), strict=True):
        if setting in values:
            continue
        values[setting] = _int_env(env, variable, default, default)
        from_env.pop(setting, None)
        if _is_set(env, variable):
            from_env[setting] = (variable, env[variable])
    rank_variable, _, size_variable = variables
    if "rank" in from_env and values["rank"] != 0 and "world_size" not in from_env and "world_size" not in given:
        raise ValueError(f"{rank_variable} is {values['rank']} but {size_variable} is unset: set both (torchrun "
                         "does), or pass th.init(world_size=...)")
    if "world_size" in from_env and values["world_size"] != 1 and "rank" not in from_env and "rank" not in given:
        raise ValueError(f"{size_variable} is {values['world_size']} but {rank_variable} is unset: set both "
                         "(torchrun does), or pass th.init(rank=...)")
