"""Who launched the process: torchrun, SLURM, MPI or nobody, read from the variables each launcher sets."""

from __future__ import annotations

import pytest

from trainer.environment import (
    ClusterEnvironment,
    detect_environment,
    first_slurm_host,
    node_rendezvous,
    resolve_environment,
)
from trainer.errors import MisconfigurationError
from trainer.strategies.ddp import DDPStrategy

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
         "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[07-09,12]", "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train"}


def test_torchrun_variables_give_rank_world_and_agent_store():
    env = detect_environment(TORCHRUN)
    assert env == ClusterEnvironment(
        name="torchrun", global_rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
        master_addr="10.0.0.1", master_port=29400, use_agent_store=True, restart_count=2,
    )
    assert env.launched


def test_torchrun_is_detected_before_slurm_inside_an_allocation():
    assert detect_environment({**SLURM, **TORCHRUN}).name == "torchrun"


def test_srun_variables_give_rank_master_from_nodelist_and_a_port_per_job():
    env = detect_environment(SLURM)
    assert (env.name, env.global_rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (
        "slurm", 5, 1, 8, 4, 1)
    assert env.master_addr == "gpu07"
    assert env.master_port == 15000 + 123456 % 20000
    assert detect_environment({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[07-09,12]", "gpu07"),
    ("gpu[12,07-09]", "gpu12"),
    ("node1,node2", "node1"),
    ("cn-a[003-004],cn-b[1-2]", "cn-a003"),
    ("rack[1-2]-gpu[01-04]", "rack1-gpu01"),
    ("single", "single"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_unreadable_nodelist_is_a_clear_error():
    with pytest.raises(MisconfigurationError, match="SLURM_NODELIST.*MASTER_ADDR"):
        first_slurm_host("gpu[07-09")


def test_interactive_or_single_task_slurm_is_not_a_launch():
    assert detect_environment({**SLURM, "SLURM_JOB_NAME": "bash"}).name == "local"
    # `sbatch` running `python train.py` without srun: one task; the Trainer starts the processes itself.
    assert detect_environment({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).name == "local"


def test_open_mpi_variables():
    env = detect_environment({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                              "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node01"})
    assert (env.name, env.global_rank, env.world_size, env.local_rank, env.node_rank, env.master_addr) == (
        "mpi", 2, 4, 0, 1, "node01")


def test_mpich_and_intel_mpi_pmi_variables():
    env = detect_environment({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.name, env.global_rank, env.world_size, env.local_rank, env.master_addr) == ("mpi", 1, 2, 1, "127.0.0.1")


def test_mpi_across_nodes_without_master_addr_says_how_to_pass_it():
    with pytest.raises(MisconfigurationError, match="mpirun -x MASTER_ADDR"):
        detect_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_no_launcher_is_local_with_a_free_port():
    env = detect_environment({})
    assert env.name == "local" and not env.launched and env.world_size == 1 and env.master_port > 0


def test_bad_integer_names_the_variable():
    with pytest.raises(MisconfigurationError, match="WORLD_SIZE='two'"):
        detect_environment({**TORCHRUN, "WORLD_SIZE": "two"})


def test_environment_override_by_name_instance_or_detection():
    custom = ClusterEnvironment(name="custom", global_rank=1, world_size=2)
    assert resolve_environment(custom) is custom
    assert resolve_environment("slurm", {**SLURM, **TORCHRUN}).name == "slurm"  # skips the torchrun reading
    assert resolve_environment(None, SLURM).name == "slurm"
    assert resolve_environment("local", TORCHRUN).name == "local"
    with pytest.raises(MisconfigurationError, match="'slurm' was asked for"):
        resolve_environment("slurm", {})
    with pytest.raises(MisconfigurationError, match="one of torchrun, slurm, mpi, local"):
        resolve_environment("kubernetes", {})


def test_ddp_strategy_uses_its_environment_override():
    custom = ClusterEnvironment(name="custom", global_rank=1, world_size=2)
    assert DDPStrategy(environment=custom).detect_environment() is custom


def test_multi_node_self_launch_needs_master_and_node_rank():
    assert node_rendezvous({"MASTER_ADDR": "n0", "MASTER_PORT": "29555", "NODE_RANK": "1"}) == ("n0", 29555, 1)
    with pytest.raises(MisconfigurationError, match="MASTER_PORT, NODE_RANK"):
        node_rendezvous({"MASTER_ADDR": "n0"})


def test_world_size_must_match_devices_times_nodes():
    strategy = DDPStrategy()
    strategy.configure("cpu", devices=2, num_nodes=1, precision="32")
    with pytest.raises(MisconfigurationError, match="torchrun started 4 process.*devices=2, num_nodes=1\\) expects 2"):
        strategy.setup_environment(detect_environment(TORCHRUN))
