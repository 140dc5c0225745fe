"""A training process of run "train" rank 0 (tests/test_run_clash_e2e.py), as two users' `train.py` on one node.

argv: the push URL, the push interval. Prints "ready" once its tracker exists, then steps every 10 ms until
a line "close" on stdin: then it closes its tracker (state idle, one final push) and prints "closed". Its
stderr holds what the hooks log (Python's last-resort handler: warnings, as a user sees them).
"""

import sys
import threading
import time

import stepscope.hooks as th


def main() -> None:
    tracker = th.init(run="train", rank=0, push_url=sys.argv[1], push_interval=float(sys.argv[2]),
                      handle_sigterm=False)
    print("ready", flush=True)
    closing = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), closing.set()), daemon=True).start()
    while not closing.is_set():  # the tracker is the training thread's: the reader thread only says when to stop
        with tracker.phase("forward"):
            time.sleep(0.01)
        tracker.step(samples=1)
    tracker.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
