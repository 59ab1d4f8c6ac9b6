"""An elastic job (torchrun --max-restarts above 0, perhaps --nnodes=MIN:MAX): read from torchrun's variables, a
launch on fewer nodes than num_nodes accepted, and the seeded order drawn even on one process. The real launch
with a node leaving is tests/torchrun/test_elastic_nodes.py."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, RandomSampler

from torchyard.trainer.cluster.environment import ClusterEnvironment, torchrun_environment
from torchyard.trainer.data.samplers import EpochSampler
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.ddp import DDPStrategy

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


def ddp(devices: int, num_nodes: int) -> DDPStrategy:
    strategy = DDPStrategy()
    strategy.configure("cpu", devices, num_nodes, "32-true")
    return strategy


def test_torchruns_restart_budget_is_read_and_an_elastic_job_may_run_on_fewer_nodes_than_num_nodes():
    elastic = torchrun_environment({**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert elastic.max_restarts == 3 and torchrun_environment(TORCHRUN).max_restarts == 0
    ddp(1, 2)._check_launch(elastic)  # one node of at most two: accepted
    with pytest.raises(MisconfigurationError) as refused:
        ddp(1, 2)._check_launch(torchrun_environment(TORCHRUN))
    assert str(refused.value) == ("torchrun started 1 process(es), but Trainer(devices=1, num_nodes=2) expects 2; make "
                                  "them match (processes per node = devices).")
    with pytest.raises(MisconfigurationError):  # more processes than devices x num_nodes: never
        ddp(1, 2)._check_launch(ClusterEnvironment("torchrun", world_size=3, max_restarts=3))


def test_one_process_of_an_elastic_job_draws_the_seeded_order_a_plain_one_its_loaders_own():
    loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
    for environment, seeded in ((ClusterEnvironment("torchrun", max_restarts=1), True),
                                (ClusterEnvironment("torchrun"), False)):
        strategy = ddp(1, 2)
        strategy.environment = environment
        sampler = strategy.prepare_loader(loader, train=True, seed=3).batch_sampler.sampler
        assert isinstance(sampler, EpochSampler) == seeded and isinstance(sampler, RandomSampler) != seeded
