"""A 2-rank Lightning DDP fit over gloo on the CPU with the stepscope callback, each rank writing its
truth (tests/support/framework_truth.py) to OUT/truth-RANK.json. Lightning's DDP launcher starts rank 1
by running this module again.

    python -m tests.support.lightning_ddp OUT PUSH_URL RUN
"""

import sys
from pathlib import Path

from tests.support.framework_truth import Truth, lightning_fit


def main(out: Path, push_url: str, run: str) -> None:
    from stepscope.hooks.lightning import StepscopeCallback

    truth = Truth()
    callback = StepscopeCallback(run=run, push_url=push_url, push_interval=1.0)
    trainer = lightning_fit(truth, out, callback, devices=2, strategy="ddp")
    truth.save(out / f"truth-{trainer.global_rank}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
