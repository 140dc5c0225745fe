"""Counting a model's FLOPs once with PyTorch's FLOP counter (`torch.utils.flop_counter.FlopCounterMode`).

MFU needs the FLOPs one training step does. A user who knows them states them (`flops_per_step=`); one
who does not runs one step's forward and backward under the counter here, and the tracker counts that
number at every step after. The counter counts the matmuls, convolutions and attention of what runs,
forward and backward (2 FLOPs per multiply-add), whatever the device or dtype, so it also counts on the
CPU or on the meta device. Imports torch only when called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def count_flops(fn: Callable[..., object], *args: Any, **kwargs: Any) -> int:
    """The FLOPs `fn(*args, **kwargs)` does, as torch's FLOP counter counts them (ValueError if none:
    a step without a matmul, convolution or attention cannot give an MFU)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:
        raise RuntimeError("measuring FLOPs needs torch (pip install 'stepscope[torch]'); or state "
                           "flops_per_step=") from None
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    flops = int(counter.get_total_flops())
    if flops <= 0:
        raise ValueError("the FLOP counter saw no matmul, convolution or attention in the function given: pass "
                         "one that runs a training step's forward and backward")
    return flops
