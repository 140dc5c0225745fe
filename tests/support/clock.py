"""A monotonic clock the test moves by hand, for code that takes its clock as an argument."""


class ManualClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
