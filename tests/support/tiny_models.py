"""The smallest models the framework tests train: what the hooks time, not what is learned."""

from torch import nn


class LinearRegressor(nn.Module):
    """A Hugging Face Trainer's model at its smallest: one linear layer, the loss in its output as the Trainer
    reads it (inputs `x`, targets `labels`)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}
