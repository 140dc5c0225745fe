"""Where the GPU-hours go: the causes a rank's held time is split into (docs/goodput.md).

The rules label their seconds per second with `cause` (CAUSES); the report adds what only a whole window
shows: the restart gap (the span between a lost process's last push and the next one's first push under
the same run name; the rules' `lost` is the part of it while the exporter still holds the lost rank) and
the lost progress (the steps a run redoes after restoring a checkpoint, where it passes its global step).
"""

from stepscope.contract.training import CHECKPOINT_STATE, EVAL_STATE, IDLE_STATE, SETUP_STATE

PRODUCTIVE = "productive"  # train, less the wait for data and stalls
DATA_WAIT = "data_wait"  # dataloader_next while in train
STALLED = "stalled"  # train without a step for longer than the pace explains (StepscopeTrainingStalled's test)
LOST = "lost"  # a rank that stopped pushing without closing, while its exporter still holds it
RESTART_GAP = "restart_gap"  # the report's: held time no process of the rank accounted for
LOST_PROGRESS = "lost_progress"  # the report's: productive time of the steps a restored run does again
STATE_CAUSES = (SETUP_STATE, EVAL_STATE, CHECKPOINT_STATE, IDLE_STATE)  # the hooks' state seconds as they are
CAUSES = (PRODUCTIVE, DATA_WAIT, STALLED, *STATE_CAUSES, LOST)  # the rules' `cause` values
REPORT_CAUSES = (PRODUCTIVE, DATA_WAIT, STALLED, LOST_PROGRESS, *STATE_CAUSES, RESTART_GAP)
ACCOUNTING_STEP = "1m"  # the resolution dashboards integrate watts and held-idle GPUs at, over a range
ACCOUNTING_STEP_SECONDS = 60
JOULES_PER_KWH = 3.6e6
