"""The hooks beside torch.compile: a phase inside a compiled function must not keep torch.compile from compiling it."""

import logging

import pytest
import torch
from torch import nn

import stepscope.hooks as th
from stepscope_testkit.processes import sample_values


def test_a_phase_inside_a_compiled_step_leaves_it_compiled_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Before, dynamo met the phase's clock (time.perf_counter_ns) inside a `with` block and ran the whole function
    eagerly: a compiled training step with its phases inside compiled no graph at all (1 without the phases)."""
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(graph)
        return graph.forward

    tracker = th.init(run="compiled-step", push_url="", handle_sigterm=False)
    model = nn.Linear(8, 1)

    @torch.compile(backend=counting_backend)
    def forward(x: torch.Tensor) -> torch.Tensor:
        with tracker.phase("forward"):
            return model(x).sum()

    for x in tracker.loader([torch.randn(4, 8) for _ in range(3)]):
        forward(x)
        with tracker.phase("optimizer_step"):  # eager: timed as ever
            pass
        tracker.step(samples=4)
    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
        text = tracker.render()
    tracker.close()

    assert len(graphs) == 1
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="optimizer_step") == [3]
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="forward") == []  # timed nothing
    assert [record.getMessage() for record in caplog.records if "torch.compile" in record.getMessage()] == [
        "stepscope: phase 'forward' is inside a function that torch.compile compiles, where it cannot time (a timed "
        "one would make torch.compile run that function uncompiled): it times nothing; time around the compiled "
        "call instead (docs/hooks.md)"]
