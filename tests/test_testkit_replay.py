"""stepscope_testkit.replay.named_samples, which the corpus checks read recorded scrapes with: the same
samples as prometheus_client's parser over the whole body, for counters, labelled gauges, a histogram's
buckets and a name the scrape lacks."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepscope.contract import families
from stepscope_testkit.replay import named_samples, recordings

NAMES = (
    (families.GPU_ENERGY, families.GPU_POWER),
    (families.STEPS_TOTAL, families.GPU_INFO, families.GPU_TENSOR_ACTIVE),
    ("stepscope_step_phase_seconds_bucket", "stepscope_step_phase_seconds_count"),
    ("stepscope_no_such_family",),
)
BODIES = [(f"{recording.name}-{name}-{at}", workload.bodies[at]) for recording in recordings()
          for name, workload in recording.workloads.items() for at in (0, len(workload.bodies) // 2, -1)]


@pytest.mark.parametrize(("label", "body"), BODIES, ids=[label for label, _ in BODIES])
def test_the_named_samples_are_the_whole_parses(label: str, body: str) -> None:
    for names in NAMES:
        whole = [sample for family in text_string_to_metric_families(body) for sample in family.samples
                 if sample.name in names]
        assert named_samples(body, names) == whole, (label, names)


def test_every_kind_of_sample_is_in_the_corpus() -> None:
    """The comparison above is not vacuous: each named set but the missing one is found in some scrape."""
    for names in NAMES[:-1]:
        assert any(named_samples(body, names) for _, body in BODIES), names
