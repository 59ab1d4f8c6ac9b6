"""A Lightning-style script: the Trainer is built and fit at the top level, with no `if __name__ == "__main__":`.

    python unguarded_script.py <out_dir>

The same run as tests/strategies/ddp_reference.py under torchrun. This process becomes rank 0 and rank 1 runs
this command line again, so everything below, the code after fit included, runs on both ranks; each writes its
weights, the result of an all-reduce after fit and what it drew from the unseeded global generators as training
started (rank 1 starts from rank 0's RNG state) to <out_dir>/rank<r>.pt.
"""

import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from ddp_reference import TORCHRUN_RUN, initial_state, reference_data, reference_net
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = reference_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=TORCHRUN_RUN["lr"], momentum=0.9)


class DrawAtStart(Callback):
    def on_train_start(self, trainer, module):
        self.draws = [torch.rand(1).item(), random.random(), float(np.random.rand())]


out = Path(sys.argv[1])
draws = DrawAtStart()
module = Net()
module.net.load_state_dict(initial_state())
# No seed anywhere: the loader's order takes the Trainer's default order seed, 0, as the reference's sampler does.
trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=TORCHRUN_RUN["epochs"], logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[draws])
loader = DataLoader(TensorDataset(*reference_data()), batch_size=TORCHRUN_RUN["batch"], shuffle=True)
trainer.fit(module, loader)

# Every rank goes on here, with the process group still up for the script's own collectives.
ranks = torch.tensor([float(trainer.global_rank)])
torch.distributed.all_reduce(ranks)
torch.save({"state_dict": module.net.state_dict(), "rank_sum": ranks.item(), "world_size": trainer.world_size,
            "draws": draws.draws}, out / f"rank{trainer.global_rank}.pt")
