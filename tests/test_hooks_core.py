"""Training hooks without a server: bucket math, rendering, config errors, limits, CUDA event logic."""

import itertools
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import types

import psutil
import pytest

import stepscope.hooks as th
from stepscope.hooks.config import Config
from stepscope.hooks.pusher import encode_label_value, group_url
from stepscope.hooks.timing import Histogram
from stepscope_testkit.processes import REPO_ROOT, sample_values, samples


def tracker(**kwargs) -> th.Tracker:
    t = th.init(run="unit", push_url="", **kwargs)
    return t


def test_observations_land_in_le_buckets_and_render_cumulative() -> None:
    hist = Histogram((0.001, 0.01, 0.1))
    for seconds in (0.0005, 0.001, 0.002, 0.01, 0.05, 5.0):
        hist.observe_ns(round(seconds * 1e9))
    assert hist.counts == [2, 2, 1, 1]  # 0.001 and 0.01 sit on their bounds: le is inclusive
    snap = hist.snapshot()
    assert snap.cumulative == (2, 4, 5, 6)
    assert snap.count == 6
    assert snap.sum_seconds == pytest.approx(5.0635)


def test_rendered_histogram_families() -> None:
    t = tracker(buckets=[0.001, 0.01], phase_buckets=True)
    t.state("train")
    phase = t.phase("forward")
    for duration_ns in (500_000, 5_000_000, 50_000_000):
        phase._hist.observe_ns(duration_ns)
    t.step(samples=8)
    t.step(samples=8)
    text = t.render()
    got = samples(text)
    bucket = "stepscope_step_phase_seconds_bucket"
    forward = {("phase", "forward"), ("timing", "host")}  # no CUDA here: host wall time, and it says so
    assert got[(bucket, frozenset({*forward, ("le", "0.001")}))] == 1
    assert got[(bucket, frozenset({*forward, ("le", "0.01")}))] == 2
    assert got[(bucket, frozenset({*forward, ("le", "+Inf")}))] == 3
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="forward") == [3]
    assert sample_values(text, "stepscope_step_phase_seconds_sum", phase="forward") == [pytest.approx(0.0555)]
    assert sample_values(text, "stepscope_steps_total") == [2]
    assert sample_values(text, "stepscope_samples_total") == [16]
    assert sample_values(text, "stepscope_step_seconds_count") == [2]
    info = dict(next(s for s in got if s[0] == "stepscope_training_info")[1])
    start_time, namespace = info.pop("start_time"), info.pop("pid_namespace")
    assert namespace == str(os.stat("/proc/self/ns/pid").st_ino)  # tells two pods' pid 1 apart
    assert info == {"local_rank": "0", "world_size": "1", "pid": str(os.getpid()), "framework": "pytorch"}
    # the creation time the exporter compares with, fixed precision, whatever namespace it looks from
    assert re.fullmatch(r"[0-9]+\.[0-9]{3}", start_time)
    assert float(start_time) == pytest.approx(psutil.Process().create_time(), abs=0.001)
    for forbidden in ("run=", "rank=", "job="):
        assert forbidden not in text.replace("local_rank=", "")
    t.close()


def test_promtool_accepts_the_body() -> None:
    t = tracker()
    with t.phase("forward"):
        pass
    t.step()
    result = subprocess.run(["promtool", "check", "metrics"], input=t.render(), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    t.close()


def test_state_set_and_scoped_state() -> None:
    t = tracker()
    assert t.current_state == "setup"
    t.state("train")
    with t.state("eval"):
        assert sample_values(t.render(), "stepscope_training_state", state="eval") == [1]
    text = t.render()
    assert sample_values(text, "stepscope_training_state", state="train") == [1]
    assert sum(sample_values(text, "stepscope_training_state")) == 1
    with pytest.raises(ValueError, match="unknown training state 'warmup'"):
        t.state("warmup")
    t.close()
    assert t.current_state == "idle"


def test_loader_times_next_and_skips_epoch_end() -> None:
    t = tracker()
    seen = []
    for item in t.loader(iter([1, 2, 3])):
        seen.append(item)
        t.step(samples=1)
    assert seen == [1, 2, 3]
    assert t.current_state == "train"
    assert sample_values(t.render(), "stepscope_step_phase_seconds_count", phase="dataloader_next") == [3]
    t.close()


def test_training_on_after_close_is_said_once_per_close(caplog) -> None:
    """A loop that trains on a closed tracker (a notebook's training cell run again after its close()) is pushed no
    more: the hooks say so once, naming reopen(), and say it again after the next close. Before, its steps were
    counted and never pushed, and nothing said so (the exporter kept the first run's 20 steps, the rank idle)."""
    t = tracker()

    def train_once() -> None:
        for _ in t.loader(range(3)):
            t.step(samples=1)
        t.close()

    def told() -> int:
        return sum("trains after close()" in r.message and "reopen()" in r.message for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
        train_once()
        assert told() == 0
        train_once()
        train_once()
        assert told() == 1
        t.step()  # a loop without loader(): its step() says it too, once
        assert told() == 1
        t.reopen()
        train_once()
        assert told() == 1
        t.step()
        assert told() == 2
    assert t.steps == 4 * 3 + 2


def test_an_eval_that_close_ends_leaves_the_rank_idle_without_a_warning(caplog) -> None:
    """close() inside an eval (SIGTERM's final push, then an earlier handler that calls sys.exit): the scope's end
    leaves the rank idle. Before, it went back to train and warned that the loop trained after close()."""
    t = tracker()
    t.state("train")
    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"), t.state("eval"):
        t.close()
    assert t.current_state == "idle"
    assert not [r for r in caplog.records if "after close()" in r.message]


def test_phase_count_is_bounded_with_one_warning(caplog) -> None:
    t = tracker(max_phases=3)
    t.state("train")
    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
        for i in range(6):
            with t.phase(f"p{i}"):
                pass
    assert len([r for r in caplog.records if "distinct phases" in r.message]) == 1
    t.step()  # phase histograms are pushed from the step histogram's first push on
    text = t.render()
    assert {s[1] for s in samples(text) if s[0] == "stepscope_step_phase_seconds_count"} == {
        frozenset({("phase", f"p{i}"), ("timing", "host")}) for i in range(3)
    }
    t.close()


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"buckets": (0.1, 0.1)}, {}, "strictly increasing"),
        ({"buckets": (0.5, 0.1)}, {}, "strictly increasing"),
        ({"buckets": (0.1, float("inf"))}, {}, "finite"),
        ({}, {"RANK": "abc"}, "RANK must be an integer >= 0 in ASCII digits, got 'abc'"),
        ({}, {"RANK": "-1"}, "RANK must be an integer >= 0"),
        ({}, {"RANK": "4", "WORLD_SIZE": "4"}, "RANK 4 must be smaller than WORLD_SIZE 4"),
        ({}, {"WORLD_SIZE": "0"}, "WORLD_SIZE must be an integer >= 1"),
        ({}, {"STEPSCOPE_PUSH_INTERVAL": "soon"}, "STEPSCOPE_PUSH_INTERVAL must be a number"),
        ({}, {"STEPSCOPE_PUSH_INTERVAL": "0"}, "STEPSCOPE_PUSH_INTERVAL must be a number > 0"),
        ({}, {"STEPSCOPE_PUSH_URL": "localhost:9847"}, "STEPSCOPE_PUSH_URL must start with http://"),
        ({}, {"STEPSCOPE_PUSH_URL": "http://127.0.0.1:abc"},
         "STEPSCOPE_PUSH_URL has a port that is not a number from 0 to 65535, got 'http://127.0.0.1:abc'"),
        ({"push_url": "http://node:98470"}, {}, "push_url has a port that is not a number from 0 to 65535"),
        ({}, {"STEPSCOPE_BUCKETS": "0.1,x"}, "STEPSCOPE_BUCKETS must be comma-separated"),
        ({}, {"STEPSCOPE_PHASE_BUCKETS": "maybe"}, "STEPSCOPE_PHASE_BUCKETS must be one of 1, true"),
        ({"phase_buckets": "yes"}, {}, "phase_buckets must be True or False"),
        ({"max_backoff": 1e10}, {}, "max_backoff must be a number > 0 and at most 600 seconds"),
        ({"push_interval": 600.5}, {}, "push_interval must be a number > 0.01 and at most 600 seconds"),
        ({"run": " "}, {}, "run must be a non-empty string"),
        ({"max_phases": 0}, {}, "max_phases must be an integer >= 1"),
    ],
)
def test_bad_config_is_a_clear_value_error(kwargs, env, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Config.resolve(env={"STEPSCOPE_RUN": "r", **env}, **kwargs)


def test_bad_phase_name_is_a_clear_value_error() -> None:
    t = tracker()
    with pytest.raises(ValueError, match="phase name must match"):
        t.phase('bad"name')
    t.close()


def test_environment_fills_identity() -> None:
    cfg = Config.resolve(env={"STEPSCOPE_RUN": "job-7", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                              "STEPSCOPE_PUSH_TOKEN": "s3cret", "STEPSCOPE_BUCKETS": "0.01,0.1,1"})
    assert (cfg.run, cfg.rank, cfg.local_rank, cfg.world_size) == ("job-7", 3, 1, 8)
    assert cfg.push_token == "s3cret"
    assert cfg.buckets == (0.01, 0.1, 1.0)
    assert cfg.push_url == "http://127.0.0.1:9847"
    assert Config.resolve(env={"RANK": "3", "WORLD_SIZE": "8"}, rank=0).rank == 0  # arguments win


def test_environment_defaults_and_empty_push_url(monkeypatch) -> None:
    """The environment table of docs/hooks.md: defaults, the interval, and an empty URL that disables pushing."""
    monkeypatch.setattr(sys, "argv", ["/jobs/train_resnet.py", "--lr", "0.1"])
    cfg = Config.resolve(env={})
    assert cfg.run == "train_resnet"  # no STEPSCOPE_RUN: the script's name
    assert (cfg.rank, cfg.local_rank, cfg.world_size, cfg.push_interval) == (0, 0, 1, 5.0)
    assert cfg.push_token is None
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert Config.resolve(env={}).run == "default"
    assert Config.resolve(env={"STEPSCOPE_RUN": "r", "STEPSCOPE_PUSH_INTERVAL": "0.5"}).push_interval == 0.5
    quiet = th.Tracker(Config.resolve(env={"STEPSCOPE_RUN": "r", "STEPSCOPE_PUSH_URL": ""}))
    assert quiet.config.push_url == "" and quiet.pusher is None
    quiet.close()


@pytest.mark.parametrize(("command", "argv0", "run"), [
    ("python -m jobs.train", "/home/a/jobs/train.py", "train"),
    ("python -m jobs", "/home/a/jobs/__main__.py", "jobs"),  # was `__main__` for every such package
    ("python - < train.py", "-", "default"),  # was `-`
])
def test_the_default_run_of_each_way_to_start_python(monkeypatch, command: str, argv0: str, run: str) -> None:
    """docs/hooks.md, "One process per run and rank": sys.argv[0] as the interpreter sets it for `command`."""
    monkeypatch.setattr(sys, "argv", [argv0])
    assert Config.resolve(env={}).run == run, command


@pytest.mark.parametrize(("argv0", "must"), [
    ("/home/a/it's.py", "must be non-empty printable text without quotes"),
    ("/home/a/" + "x" * 140 + ".py", "must be at most 128 characters, got 140"),
])
def test_a_default_run_the_exporter_refuses_is_named_as_the_scripts_name(monkeypatch, argv0: str, must: str) -> None:
    """Before: `python "it's.py"` was told "run must be ...", and a script of 140 characters "run must be at most 128
    characters, got 140": an argument the user never passed, and no word of how to name the run."""
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(ValueError) as refused:
        Config.resolve(env={"STEPSCOPE_RUN": ""})  # empty: as if unset
    assert str(refused.value).startswith(
        "the run, the script's name by default (name it with STEPSCOPE_RUN or init(run=...)), " + must)
    with pytest.raises(ValueError, match=r"^STEPSCOPE_RUN must be non-empty printable"):
        Config.resolve(env={"STEPSCOPE_RUN": "it's"})


# Each launcher's variables for one process, rank 1 of 4 (local rank 1), from their docs: srun(1) "OUTPUT
# ENVIRONMENT VARIABLES"; Open MPI 5 "Environment variables set for MPI applications" (docs.open-mpi.org,
# tuning-apps/environment-var); MPICH's and Intel MPI's Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID).
SRUN_TASK = {"SLURM_JOB_ID": "1001", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_NTASKS": "4"}
LAUNCHED = {
    "srun": SRUN_TASK,
    "mpirun (Open MPI)": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
    "mpiexec (MPICH, Intel MPI)": {"PMI_RANK": "1", "MPI_LOCALRANKID": "1", "PMI_SIZE": "4"},
    # mpirun inside a Slurm batch script: the batch step's SLURM_PROCID 0 and SLURM_NTASKS are no rank of it
    "mpirun in sbatch": {"SLURM_JOB_ID": "1001", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4",
                         "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
    "torchrun": {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"},
    # an sbatch script that exports WORLD_SIZE and MASTER_ADDR for init_process_group, the rank read in Python
    "srun, WORLD_SIZE exported": {**SRUN_TASK, "WORLD_SIZE": "4", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"},
}


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_each_launcher_gives_its_processes_their_rank_and_world_size(launcher: str) -> None:
    """Under srun or mpirun without torchrun every process was rank 0 of 1: two srun tasks on one node both pushed
    run 'train' rank 0, and the second was refused (409) at each of its 17 pushes, its steps never stored."""
    config = Config.resolve(env={"STEPSCOPE_RUN": "r", **LAUNCHED[launcher]})
    assert (config.rank, config.local_rank, config.world_size) == (1, 1, 4)


def test_torchs_variables_win_over_the_launcher_that_started_torchrun() -> None:
    """torchrun inside srun (one task per node): RANK and WORLD_SIZE are the truth; srun's task of 2 is no rank."""
    inside = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2", "RANK": "9", "LOCAL_RANK": "1",
              "WORLD_SIZE": "16"}
    config = Config.resolve(env={"STEPSCOPE_RUN": "r", **inside})
    assert (config.rank, config.local_rank, config.world_size) == (9, 1, 16)
    assert Config.resolve(env={"STEPSCOPE_RUN": "r", **SRUN_TASK}, rank=3).rank == 3  # arguments win


def test_a_batch_scripts_own_slurm_variables_make_no_world() -> None:
    """`python train.py` in an sbatch script of --ntasks=4 (no srun): one process, rank 0 of 1, not of 4 (the run
    report would say 3 ranks never reported)."""
    batch = {"SLURM_JOB_ID": "1001", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    config = Config.resolve(env={"STEPSCOPE_RUN": "r", **batch})
    assert (config.rank, config.world_size) == (0, 1)


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "1"}, "RANK is 1 but WORLD_SIZE is unset: set both (torchrun does), or pass th.init(world_size=...)"),
    ({"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "4"}, "SLURM_PROCID 4 must be smaller than SLURM_STEP_NUM_TASKS 4"),
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, "PMI_RANK must be an integer >= 0 in ASCII digits, got 'x'"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is 2 but RANK is unset: set both (torchrun does), or pass th.init(rank=...)"),
    ({**SRUN_TASK, "WORLD_SIZE": "8"},  # srun's 4 tasks are not these 8 ranks: no rank of theirs is taken
     "WORLD_SIZE is 8 but RANK is unset: set both (torchrun does), or pass th.init(rank=...)"),
])
def test_a_rank_and_a_world_size_that_do_not_pair_name_the_variables_set(env: dict[str, str], message: str) -> None:
    """`RANK=1` without WORLD_SIZE was told "RANK 1 must be smaller than world_size 1": a setting never made; every
    process with WORLD_SIZE=2 and no RANK was rank 0 of 2 (two srun tasks: one refused, 409, at each push)."""
    with pytest.raises(ValueError) as refused:
        Config.resolve(env={"STEPSCOPE_RUN": "r", **env})
    assert str(refused.value) == message
    assert Config.resolve(env={"STEPSCOPE_RUN": "r", "RANK": "1"}, world_size=2).world_size == 2
    assert Config.resolve(env={"STEPSCOPE_RUN": "r", "WORLD_SIZE": "2"}, rank=1).rank == 1


@pytest.mark.parametrize(("lightning", "rank"), [
    ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, 1),
    ({"LOCAL_RANK": "1"}, 1),
    ({"LOCAL_RANK": "0", "NODE_RANK": "0"}, 0),
])
def test_lightnings_launcher_gives_each_rank_of_its_first_node_its_own(lightning: dict[str, str], rank: int) -> None:
    """Lightning's launcher (Trainer(strategy="ddp") without torchrun) starts each rank with WORLD_SIZE, LOCAL_RANK
    and NODE_RANK, no RANK (lightning.fabric's subprocess_script launcher): th.init() in the script raised
    "WORLD_SIZE is 2 but RANK is unset" in every rank, ending the fit. On its first node the local rank is the rank;
    on a later one the devices per node are in no variable, and it still raises."""
    config = Config.resolve(env={"STEPSCOPE_RUN": "r", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", **lightning})
    assert (config.rank, config.local_rank, config.world_size) == (rank, rank, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE is 4 but RANK is unset"):
        Config.resolve(env={"STEPSCOPE_RUN": "r", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1"})


@pytest.mark.parametrize(("slurm", "run"), [
    ({"SLURM_JOB_ID": "2001"}, "train-2001"),
    ({"SLURM_JOB_ID": "3002", "SLURM_ARRAY_JOB_ID": "3000", "SLURM_ARRAY_TASK_ID": "2"}, "train-3000_2"),
    ({"SLURM_JOB_ID": " "}, "train"),
])
def test_the_default_run_of_a_slurm_job_is_its_own(monkeypatch, caplog, slurm: dict[str, str], run: str) -> None:
    """Two jobs (or two tasks of an array) of one train.py on a node were both run 'train': the second's pushes were
    refused (409) while the first ran, 10 of them in 3 s. The run is the script's name and the job's id as Slurm
    writes it (%j, %A_%a); all the job's ranks share it."""
    monkeypatch.setattr(sys, "argv", ["/jobs/train.py"])
    assert Config.resolve(env=slurm).run == run
    assert Config.resolve(env={**slurm, "STEPSCOPE_RUN": "mine"}).run == "mine"
    for name in ("STEPSCOPE_RUN", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="stepscope.hooks"):
        th.init(push_url="").close()
    said = "and the Slurm job's id " if run != "train" else ""
    assert f"stepscope: the run, the script's name {said}by default (name it with STEPSCOPE_RUN or init(run=...)), " \
           f"is {run!r}" in caplog.text


@pytest.mark.parametrize(("kubeflow", "run", "origin"), [
    # Kubeflow Trainer v2's torch runtime, node 1 of a TrainJob `llama-a` (kubeflow/trainer's torch plugin)
    ({"PET_MASTER_ADDR": "llama-a-node-0-0.llama-a", "PET_NODE_RANK": "1", "HOSTNAME": "llama-a-node-0-1-x7k2p"},
     "train-llama-a", "the Kubeflow TrainJob's name"),
    # training-operator v1: a PyTorchJob `resnet-a`'s worker 2 and its master
    ({"MASTER_ADDR": "resnet-a-master-0", "HOSTNAME": "resnet-a-worker-2", "RANK": "3", "WORLD_SIZE": "4"},
     "train-resnet-a", "the PyTorchJob's name"),
    ({"MASTER_ADDR": "resnet-a-master-0", "HOSTNAME": "resnet-a-master-0", "RANK": "0", "WORLD_SIZE": "4"},
     "train-resnet-a", "the PyTorchJob's name"),
    # an elastic PyTorchJob's worker 1 (workers only: no MASTER_ADDR)
    ({"PET_RDZV_ENDPOINT": "resnet-e-worker-0:23456", "PET_NNODES": "2:4", "HOSTNAME": "resnet-e-worker-1"},
     "train-resnet-e", "the PyTorchJob's name"),
    ({"PET_RDZV_ENDPOINT": "etcd-0:2379", "HOSTNAME": "resnet-e-worker-1"}, "train", None),
    # a MASTER_ADDR that no PyTorchJob set (the pod is no replica of that job), torchrun's own, a hand-made
    # TrainJob-like address of two names: no job
    ({"MASTER_ADDR": "resnet-a-master-0", "HOSTNAME": "gpu-node-7"}, "train", None),
    ({"MASTER_ADDR": "127.0.0.1", "HOSTNAME": "resnet-a-worker-2"}, "train", None),
    ({"PET_MASTER_ADDR": "llama-a-node-0-0.llama-b"}, "train", None),
    # a Slurm job's id wins over a MASTER_ADDR its script exported
    ({"SLURM_JOB_ID": "2001", "MASTER_ADDR": "resnet-a-master-0", "HOSTNAME": "resnet-a-master-0"},
     "train-2001", "the Slurm job's id"),
])
def test_the_default_run_of_a_kubeflow_job_is_its_own(
    monkeypatch, kubeflow: dict[str, str], run: str, origin: str | None
) -> None:
    """Two TrainJobs (or PyTorchJobs) of one image on a node were both run 'train': the second's pushes were refused
    (409) while the first ran, and on two nodes StepscopeRunNameClash fired and the run rules mixed them. The run is
    the script's name and the job's, read from the address of its first pod that the controller sets in every one."""
    monkeypatch.setattr(sys, "argv", ["/app/train.py"])
    config = Config.resolve(env=kubeflow)
    assert config.run == run
    said = f"and {origin} " if origin else ""
    assert config.from_env["run"][0] == f"the run, the script's name {said}by default (name it with STEPSCOPE_RUN " \
                                        "or init(run=...)),"
    assert Config.resolve(env={**kubeflow, "STEPSCOPE_RUN": "mine"}).run == "mine"


RAY_WORKER_ARGV = ["/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py",
                   "--node-ip-address=10.0.0.5", "--node-manager-port=53621"]  # as Ray 2.60 starts a worker


def _ray_train(monkeypatch, experiment: str | None) -> None:
    """ray.train as a Ray Train worker has it imported: get_context().get_experiment_name() answers the run's name
    (seen in real Ray 2.60 workers: RunConfig(name=...), else `ray_train_run-<date>_<time>`); None: a plain Ray
    worker, whose get_context() raises."""
    def get_context() -> types.SimpleNamespace:
        if experiment is None:
            raise RuntimeError("`get_context` can only be called from within a Ray Train worker")
        return types.SimpleNamespace(get_experiment_name=lambda: experiment)
    monkeypatch.setitem(sys.modules, "ray.train", types.SimpleNamespace(get_context=get_context))


@pytest.mark.parametrize(("experiment", "run", "origin"), [
    ("llama-a", "llama-a", "Ray Train's run name"),
    ("ray_train_run-2026-11-29_19-46-25", "ray_train_run-2026-11-29_19-46-25", "Ray Train's run name"),
    (None, "ray-job-01000000", "Ray's job id"),
])
def test_a_ray_train_worker_is_named_by_its_ray_train_run(
    monkeypatch, caplog, experiment: str | None, run: str, origin: str
) -> None:
    """A TorchTrainer of 2 workers on real Ray 2.60 pushed run 'default_worker' (the worker's script): every Ray
    Train run of a cluster was one run, and two on a node clashed. Ray sets RANK and WORLD_SIZE already."""
    monkeypatch.setattr(sys, "argv", RAY_WORKER_ARGV)
    _ray_train(monkeypatch, experiment)
    env = {"RAY_JOB_ID": "01000000", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "STEPSCOPE_PUSH_URL": ""}
    config = Config.resolve(env=env)
    assert (config.run, config.rank, config.world_size) == (run, 1, 2)
    assert Config.resolve(env={**env, "STEPSCOPE_RUN": "mine"}).run == "mine"
    with caplog.at_level(logging.INFO, logger="stepscope.hooks"):
        th.Tracker(config).close()
    assert f"stepscope: the run, {origin} by default (name it with STEPSCOPE_RUN or init(run=...)), is {run!r}" \
        in caplog.text


def _in_a_notebook_kernel(monkeypatch, **namespace: str) -> None:
    """sys as ipykernel 7.4 sets it in a kernel (seen in a real one): argv [.../ipykernel_launcher.py, -f,
    <connection file>], ipykernel loaded, and `__main__` the user's namespace, which has no `__file__`."""
    monkeypatch.setattr(sys, "argv", ["/venv/lib/site-packages/ipykernel_launcher.py", "-f", "/tmp/kernel-1f.json"])
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    main = types.ModuleType("__main__")
    main.__dict__.update(namespace)
    monkeypatch.setitem(sys.modules, "__main__", main)


@pytest.mark.parametrize(("env", "namespace", "run"), [
    ({"JPY_SESSION_NAME": "work/exp/Untitled1.ipynb"}, {}, "Untitled1"),  # Jupyter's server: the notebook's path
    ({}, {"__vsc_ipynb_file__": "/home/a/prep data.ipynb"}, "prep data"),  # VS Code
    ({}, {}, "notebook-{pid}"),  # a kernel that names no notebook: one run per kernel (its pid, filled in below:
])  # in the parameters, each xdist worker's own pid made its collection differ from the others' and none ran)
def test_a_notebook_is_named_by_its_notebook_not_the_kernel_launcher(
    monkeypatch, caplog, env: dict[str, str], namespace: dict[str, str], run: str
) -> None:
    """Every notebook was run `ipykernel_launcher`: in two real kernels on one exporter, the second's pushes were
    refused (409, 4 of 5) and the exporter held one run. init logs the run it chose and how to name it."""
    _in_a_notebook_kernel(monkeypatch, **namespace)
    with caplog.at_level(logging.INFO, logger="stepscope.hooks"):
        tracker = th.Tracker(Config.resolve(env={"STEPSCOPE_PUSH_URL": "", **env}))
        tracker.close()
    run = run.format(pid=os.getpid())
    assert tracker.config.run == run
    assert f"by default (name it with STEPSCOPE_RUN or init(run=...)), is {run!r}; rank 0 of 1" in caplog.text


def test_a_script_that_imports_ipykernel_is_still_named_by_its_file(monkeypatch) -> None:
    """Only a kernel's namespace, which has no `__file__`, is a notebook."""
    _in_a_notebook_kernel(monkeypatch, __file__="/jobs/train.py")
    monkeypatch.setattr(sys, "argv", ["/jobs/train.py"])
    assert Config.resolve(env={"JPY_SESSION_NAME": "a.ipynb"}).run == "train"


def test_log_buckets_helper_gives_readable_log_spaced_bounds() -> None:
    bounds = th.log_buckets(1e-4, 60.0, 16)
    assert len(bounds) == 16 and bounds[0] == 0.0001 and bounds[-1] == 60.0
    # (60 / 1e-4) ** (1 / 15) = 2.43 between neighbours, give or take the 2-significant-digit rounding
    assert all(2.3 < b / a < 2.6 for a, b in itertools.pairwise(bounds))
    assert all(float(f"{b:.2g}") == b for b in bounds)  # 2 significant digits: readable `le`


def test_group_url_encodes_unusual_run_names_pushgateway_style() -> None:
    assert group_url("http://h:1/", "resnet-a", 2) == "http://h:1/metrics/job/stepscope/run/resnet-a/rank/2"
    assert group_url("http://h:1", "team/exp 1", 0) == (
        f"http://h:1/metrics/job/stepscope/run@base64/{encode_label_value('team/exp 1')}/rank/0"
    )
    assert encode_label_value("a/b") == "YS9i"
    assert encode_label_value("team/exp 1") == "dGVhbS9leHAgMQ=="  # url-safe alphabet, padded
    assert encode_label_value("") == "="
    for dots, encoded in ((".", "Lg=="), ("..", "Li4=")):  # plain, but URL dot segments: requests drops them
        assert group_url("http://h:1", dots, 0) == f"http://h:1/metrics/job/stepscope/run@base64/{encoded}/rank/0"


def test_imports_and_works_without_torch_and_exporter() -> None:
    """The hooks alone (`pip install stepscope`, no extras): no torch, no exporter, no server library."""
    code = textwrap.dedent("""
        import sys
        for absent in ("torch", "stepscope.exporter", "h11", "bcrypt", "yaml", "pynvml"):
            sys.modules[absent] = None
        import stepscope.hooks as th
        t = th.init(run="no-torch", push_url="")
        for _ in t.loader(range(2)):
            with t.phase("forward", cuda=True):
                pass
            t.step(samples=2)
        text = t.render()
        assert 'stepscope_step_phase_seconds_count{phase="forward",timing="host"} 2' in text, text
        assert "stepscope_steps_total 2" in text
        t.close()
        assert not any(m == "torch" or m.startswith(("torch.", "stepscope.exporter", "lightning", "transformers"))
                       for m in sys.modules if sys.modules[m] is not None)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_phase_a_rank_is_in_and_its_last_step_are_pushed() -> None:
    """What names a hung rank: the host-timed phase entered last and not left (a cuda=True phase on a
    machine without CUDA is timed on the host too), and when the last step ended."""
    t = th.init(run="where", push_url="", handle_sigterm=False)
    assert t.snapshot().last_step_time is None and t.snapshot().open_phase is None
    t.state("train")
    with t.phase("forward"):
        pass
    t.step()
    before = time.time()
    assert t.snapshot().open_phase is None, "between phases"
    backward = t.phase("backward", cuda=True)
    backward.start()
    name, entered = t.snapshot().open_phase
    assert name == "backward" and before - 1 < entered <= time.time()
    assert t.snapshot().last_step_time <= entered
    backward.end()
    assert t.snapshot().open_phase is None
    t.close()
