"""A 2-rank Hugging Face Trainer run over gloo on the CPU with the stepscope callback, started by torchrun
as users start it, each rank writing its truth (tests/support/framework_truth.py) to OUT/truth-RANK.json.

    torchrun --standalone --nproc-per-node 2 -m tests.support.huggingface_ddp OUT PUSH_URL RUN
"""

import os
import sys
from pathlib import Path

from tests.support.framework_truth import Truth, huggingface_train


def main(out: Path, push_url: str, run: str) -> None:
    from stepscope.hooks.huggingface import StepscopeCallback

    truth = Truth()
    callback = StepscopeCallback(run=run, push_url=push_url, push_interval=1.0)
    trainer = huggingface_train(truth, out / f"rank-{os.environ['RANK']}", callback)
    assert trainer.args.world_size == 2, trainer.args.world_size  # really distributed, not two lone runs
    truth.save(out / f"truth-{os.environ['RANK']}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
