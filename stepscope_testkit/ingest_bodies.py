"""Hand-written push bodies (text exposition 0.0.4) for the ingest tests, one knob per variation."""

import os
from collections.abc import Callable, Mapping, Sequence


def histogram(name: str, buckets: Sequence[tuple[str, float]], count: float, total: float,
              labels: str = "") -> str:
    """Lines of one histogram series; `labels` like 'phase="forward"' (no braces)."""
    sep = "," if labels else ""
    lines = [f'{name}_bucket{{{labels}{sep}le="{le}"}} {value}' for le, value in buckets]
    braces = f"{{{labels}}}" if labels else ""
    lines += [f"{name}_count{braces} {count}", f"{name}_sum{braces} {total}"]
    return "\n".join(lines) + "\n"


def phase_family(phases: Sequence[str] = ("dataloader_next", "forward"), steps: int = 4) -> str:
    body = "# HELP stepscope_step_phase_seconds Phase time.\n# TYPE stepscope_step_phase_seconds histogram\n"
    for phase in phases:
        body += histogram("stepscope_step_phase_seconds",
                          [("0.01", 0), ("0.1", max(steps - 1, 0)), ("+Inf", steps)], steps, 0.05 * steps,
                          f'phase="{phase}"')
    return body


def step_family(steps: int = 4) -> str:
    return ("# TYPE stepscope_step_seconds histogram\n"
            + histogram("stepscope_step_seconds", [("0.1", min(steps, 1)), ("1", steps), ("+Inf", steps)],
                        steps, 0.3 * steps))


def counter(name: str, value: float) -> str:
    return f"# HELP {name} A counter.\n# TYPE {name} counter\n{name} {value}\n"


def info_family(pid: int | None = None, framework: str = "torch", start_time: str | None = None,
                pid_namespace: str | None = None) -> str:
    """The identity sample; the optional labels `start_time` (Unix seconds) and `pid_namespace` (an inode) are
    left out when None."""
    pid = os.getpid() if pid is None else pid
    started = "" if start_time is None else f',start_time="{start_time}"'
    namespace = "" if pid_namespace is None else f',pid_namespace="{pid_namespace}"'
    return ("# TYPE stepscope_training_info gauge\n"
            f'stepscope_training_info{{local_rank="0",world_size="2",pid="{pid}",'
            f'framework="{framework}"{started}{namespace}}} 1\n')


def state_family(current: str = "train", states: Sequence[str] = ("setup", "train", "eval")) -> str:
    lines = [f'stepscope_training_state{{state="{s}"}} {int(s == current)}' for s in states]
    return "# TYPE stepscope_training_state gauge\n" + "\n".join(lines) + "\n"


def full_body(steps: int = 4, pid: int | None = None, phases: Sequence[str] = ("dataloader_next", "forward"),
              state: str = "train") -> str:
    """Every accepted family, as a hooks client pushes it."""
    return (phase_family(phases, steps) + step_family(steps)
            + counter("stepscope_steps_total", steps) + counter("stepscope_samples_total", 32 * steps)
            + info_family(pid) + state_family(state))


STANDARD_PHASES = ("dataloader_next", "to_device", "forward", "backward", "optimizer_step", "train_batch",
                   "step_lr_schedulers", "from_device", "reduce_metrics")


def hooks_body(phases: Sequence[str] = STANDARD_PHASES, steps: int = 12_345, pid: int = 4242,
               seed: int = 0, buckets: int = 16) -> str:
    """What stepscope.hooks.render pushes for a rank that ran `steps` steps: the realistic body (9 phases,
    16 log-spaced buckets from 100 µs to 60 s: ~14 KB), with log-normal phase times over the buckets."""
    import random

    from stepscope.hooks.config import log_buckets
    from stepscope.hooks.render import Snapshot, render
    from stepscope.hooks.timing import Histogram

    rng = random.Random(seed)
    bounds = log_buckets(1e-4, 60.0, buckets)

    def observed(median: float) -> Histogram:
        hist = Histogram(bounds)
        for _ in range(min(steps, 2000)):
            hist.observe_ns(int(rng.lognormvariate(0, 0.6) * median * 1e9))
        return hist

    snap = Snapshot(
        phases=[(phase, "host", observed(0.002 * (i + 1)).snapshot()) for i, phase in enumerate(phases)],
        step=observed(0.05).snapshot(), steps=steps, samples=32 * steps, state="train",
        info={"local_rank": "0", "world_size": "8", "pid": str(pid), "framework": "torch",
              "start_time": "1712345678.25"},
    )
    return render(snap)


# Bodies built to be expensive for a parser, by size in bytes: prometheus_client's parser takes seconds to
# minutes on the first and the escaped quotes; a linear parser takes about the same time per byte on all.
HOSTILE_SHAPES: Mapping[str, Callable[[int], str]] = {
    "comment line of blanks": lambda n: "#" + " " * n + "x\n",
    "blank lines": lambda n: "\n" * n,
    "comment lines": lambda n: "# x\n" * (n // 4),
    "escaped quotes in a label value": lambda n: ('# TYPE stepscope_model_flops_total counter\n'
                                                  'stepscope_model_flops_total{dtype="' + '\\"' * (n // 2) + '"} 1\n'),
    "blanks inside braces": lambda n: ('# TYPE stepscope_steps_total counter\n'
                                       "stepscope_steps_total{" + " " * n + "} 1\n"),
    "long label name": lambda n: '# TYPE stepscope_steps_total counter\nstepscope_steps_total{' + "a" * n + '="1"} 1\n',
    "long number": lambda n: "# TYPE stepscope_steps_total counter\nstepscope_steps_total " + "1" * n + "\n",
    "many small samples": lambda n: "# TYPE stepscope_model_flops_total counter\n" + "".join(
        f'stepscope_model_flops_total{{dtype="s{i}"}} 0\n' for i in range(n // 40)),
}
