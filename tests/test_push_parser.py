"""The strict push parser against prometheus_client's parser (the oracle) and against hostile shapes.

Property: whatever the strict parser accepts, the oracle reads as the same samples (run and rank from
the path, `_created` dropped, `le` Go-formatted, empty labels absent). Checked on what the hooks,
prometheus_client and hand-written clients send, and on seeded random mutations of those bodies.
"""

import contextlib
import math
import random
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from stepscope.exporter.ingest.errors import Rejected
from stepscope.exporter.ingest.parser import PushLimits, parse_push
from stepscope_testkit.ingest_bodies import HOSTILE_SHAPES, full_body, hooks_body

LIMITS = PushLimits(max_label_length=128, max_series=2000, max_phases=32)
Samples = set[tuple[str, frozenset[tuple[str, str]], str]]


def _value(value: float) -> str:
    return "NaN" if math.isnan(value) else repr(float(value))


def oracle(body: str, run: str = "r", rank: str = "0") -> Samples:
    """The samples prometheus_client reads from a body, in the exporter's canonical form."""
    found: Samples = set()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {k: v for k, v in sample.labels.items() if v}
            if "le" in labels:
                labels["le"] = floatToGoString(float(labels["le"]))
            labels.update(run=run, rank=rank)
            found.add((sample.name, frozenset(labels.items()), _value(sample.value)))
    return found


def strict(body: str, run: str = "r", rank: str = "0") -> Samples:
    parsed = parse_push(body.encode(), run, rank, LIMITS)
    text = b"".join(family.lines for family in parsed.values()).decode()
    return {(s.name, frozenset(s.labels.items()), _value(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples}


def client_library_body() -> str:
    """What a stock prometheus_client registry pushes: HELP/TYPE, `_created`, escaped label values."""
    registry = CollectorRegistry()
    phases = Histogram("stepscope_step_phase_seconds", "Phase time", ["phase"], registry=registry,
                       buckets=(0.001, 0.01, 0.1, 1.0))
    for phase, seconds in (("forward", 0.004), ("backward", 0.02), ('we"ird\\na\nme', 0.5)):
        phases.labels(phase).observe(seconds)
    Histogram("stepscope_step_seconds", "Step time", registry=registry).observe(0.03)
    Counter("stepscope_steps", "Steps", registry=registry).inc(42)
    Counter("stepscope_samples", "Samples", registry=registry).inc(1344)
    info = Gauge("stepscope_training_info", "Info", ["local_rank", "world_size", "pid", "framework", "start_time"],
                 registry=registry)
    info.labels("0", "8", "4242", 'torch "2.13"', "1712345678.25").set(1)
    state = Gauge("stepscope_training_state", "State", ["state"], registry=registry)
    for name in ("setup", "train", "eval"):
        state.labels(name).set(int(name == "train"))
    return generate_latest(registry).decode()


VALID_BODIES = {
    "hooks, 9 phases": hooks_body(),
    "hand-written": full_body(),
    "prometheus_client": client_library_body(),
    "blank lines, comments, tabs, trailing comma": (
        "\n# a comment\n#\n  # TYPE stepscope_steps_total counter\n"
        'stepscope_steps_total{ rank = "0" , }\t5\n\n'),
}


@pytest.mark.parametrize("name", list(VALID_BODIES))
def test_valid_bodies_read_as_the_oracle_reads_them(name: str) -> None:
    body = VALID_BODIES[name]
    assert strict(body) == oracle(body)
    assert strict(body)


def test_label_escapes_survive_to_the_exposition() -> None:
    parsed = parse_push(client_library_body().encode(), "r", "0", LIMITS)
    lines = parsed["stepscope_step_phase_seconds"].lines.decode()
    assert 'phase="we\\"ird\\\\na\\nme"' in lines
    assert 'framework="torch \\"2.13\\""' in parsed["stepscope_training_info"].lines.decode()


MUTATION_CHARACTERS = '{}",=\\ \n\t#eE+-.0123456789abcxyz_'


def mutate(body: str, rng: random.Random) -> str:
    lines = body.split("\n")
    kind = rng.randrange(6)
    at = rng.randrange(len(body) + 1)
    if kind == 0:
        return body[:at] + body[at + 1:]
    if kind == 1:
        return body[:at] + rng.choice(MUTATION_CHARACTERS) + body[at:]
    if kind == 2:
        return body[:at] + rng.choice(MUTATION_CHARACTERS) + body[at + 1:]
    if kind == 3:
        line = rng.randrange(len(lines))
        lines.insert(rng.randrange(len(lines) + 1), lines[line])
        return "\n".join(lines)
    if kind == 4:
        a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[a], lines[b] = lines[b], lines[a]
        return "\n".join(lines)
    return body[:at]


@pytest.mark.parametrize("name", list(VALID_BODIES))
def test_mutated_bodies_are_refused_or_read_as_the_oracle_reads_them(name: str) -> None:
    rng = random.Random(name)
    accepted = 0
    for _ in range(150 if name == "hooks, 9 phases" else 600):
        body = mutate(mutate(VALID_BODIES[name], rng), rng)
        try:
            mine = strict(body)
        except Rejected as rejected:
            assert rejected.status == 400 and rejected.message
            continue
        accepted += 1
        assert mine == oracle(body), body
    assert accepted > 0  # the mutations also produce bodies both parsers accept


def _cpu_seconds(body: bytes) -> float:
    """The least CPU time of five parses of the body, refused or not."""
    best = math.inf
    for _ in range(5):
        started = time.process_time()
        with contextlib.suppress(Rejected):
            parse_push(body, "r", "0", LIMITS)
        best = min(best, time.process_time() - started)
    return best


@pytest.mark.parametrize("shape", list(HOSTILE_SHAPES))
def test_hostile_bodies_cost_linear_time(shape: str) -> None:
    """Sixteen times the bytes cost about sixteen times the CPU; quadratic would be 256. The bound sits
    between them, at 64: a 1 MiB body no longer fits the caches a 64 KiB one does, and its copies fault in
    fresh pages, so a linear parse measured 22-30x here, idle or beside six busy loops (4x the bytes read
    7-10x for the same reason, and failed a CI run at 9.6x). A ratio within one process, not a time budget
    (benchmarks/bench_ingest.py has those)."""
    small, large = (HOSTILE_SHAPES[shape](size).encode() for size in (64 * 1024, 1024 * 1024))
    ratio = _cpu_seconds(large) / max(_cpu_seconds(small), 1e-4)
    assert ratio < 64, f"{shape}: 16x the bytes cost {ratio:.1f}x the CPU"


@pytest.mark.parametrize(("line", "reason", "text"), [
    ('stepscope_step_phase_seconds_bucket{phase="f",le="0.1"} -1', "bad_value", "counts must be finite and >= 0"),
    ('stepscope_step_phase_seconds_bucket{phase="f",le="0.01"} 1', "malformed", "NaN or duplicate le"),
    ('stepscope_step_phase_seconds_bucket{phase="f",le="' + "9" * 200 + '"} 1', "label_too_long", "'le'"),
    ('stepscope_step_phase_seconds_bucket{le="x",phase="f"} 1', "malformed", "le is not a number"),
])
def test_later_buckets_of_a_series_are_checked_like_the_first(line: str, reason: str, text: str) -> None:
    """The second and later buckets of a series skip re-checking the labels they share with the first:
    what differs (le, the count) is still checked."""
    body = ("# TYPE stepscope_step_phase_seconds histogram\n"
            'stepscope_step_phase_seconds_bucket{phase="f",le="0.01"} 1\n' + line + "\n"
            'stepscope_step_phase_seconds_bucket{phase="f",le="+Inf"} 2\n'
            'stepscope_step_phase_seconds_count{phase="f"} 2\nstepscope_step_phase_seconds_sum{phase="f"} 0.1\n')
    with pytest.raises(Rejected) as info:
        parse_push(body.encode(), "r", "0", LIMITS)
    assert info.value.reason == reason
    assert text in info.value.message


def test_a_refused_sample_is_quoted_on_one_line_as_it_was_written() -> None:
    """The refusal is the 400's body and the exporter's log line: a label value's newline, sent escaped, must stay
    escaped there, or a client writes lines of its own into the exporter's log."""
    sample = ('stepscope_training_info{framework="torch \\"2.13\\" \\\\\\nforged log line",local_rank="0",'
              'world_size="1"}')
    with pytest.raises(Rejected) as info:
        parse_push(f"# TYPE stepscope_training_info gauge\n{sample} 1\n".encode(), "r", "0", LIMITS)
    assert info.value.message == f"{sample}: missing label 'pid'"
