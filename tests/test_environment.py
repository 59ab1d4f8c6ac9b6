"""Who launched the process: torchrun, SLURM, MPI or nobody, read from the variables each launcher sets."""

from __future__ import annotations

import pytest

from torchyard.trainer.cluster.environment import (
    ClusterEnvironment,
    detect_environment,
    expand_hostlist,
    expand_tasks_per_node,
    first_slurm_host,
    node_rendezvous,
    resolve_environment,
    worker_threads,
)
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.ddp import DDPStrategy

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "2"}
def srun_task(proc_id: int, *, tasks_per_node: list[int], step_nodelist: str, compressed_counts: str,
              job_id: int = 123456, job_nodelist: str | None = None, job_name: str = "train", step_id: int = 0,
              **extra: str) -> dict[str, str]:
    """The SLURM variables srun gives task `proc_id` of a block-distributed step, as on the real SLURM 22.05 of
    tests/cluster (a capture is REAL_SRUN_N2 below); multi-node values follow srun(1)'s OUTPUT ENVIRONMENT VARIABLES.
    Counts and node lists are given literally, compressed as SLURM writes them, not computed by the code under test."""
    first_tasks = [sum(tasks_per_node[:node]) for node in range(len(tasks_per_node))]
    node = max(n for n, first in enumerate(first_tasks) if first <= proc_id)
    ntasks, nnodes, job_nodelist = sum(tasks_per_node), len(tasks_per_node), job_nodelist or step_nodelist
    gtids = ",".join(str(first_tasks[node] + i) for i in range(tasks_per_node[node]))
    return {
        "SLURM_CLUSTER_NAME": "cluster", "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_CPUS_ON_NODE": "8",
        "SLURM_DISTRIBUTION": "block", "SLURM_GTIDS": gtids, "SLURM_JOBID": str(job_id), "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_CPUS_PER_NODE": f"8(x{nnodes})" if nnodes > 1 else "8", "SLURM_JOB_GID": "1000",
        "SLURM_JOB_NAME": job_name, "SLURM_JOB_NODELIST": job_nodelist, "SLURM_NODELIST": job_nodelist,
        "SLURM_JOB_NUM_NODES": str(nnodes), "SLURM_NNODES": str(nnodes), "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_UID": "1000", "SLURM_JOB_USER": "alice", "SLURM_LAUNCH_NODE_IPADDR": "10.1.0.5",
        "SLURM_LOCALID": str(proc_id - first_tasks[node]), "SLURM_NODEID": str(node), "SLURM_NPROCS": str(ntasks),
        "SLURM_NTASKS": str(ntasks), "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": str(proc_id),
        "SLURM_SRUN_COMM_HOST": "10.1.0.5", "SLURM_SRUN_COMM_PORT": "41231", "SLURM_STEPID": str(step_id),
        "SLURM_STEP_ID": str(step_id), "SLURM_STEP_LAUNCHER_PORT": "41231", "SLURM_STEP_NODELIST": step_nodelist,
        "SLURM_STEP_NUM_NODES": str(nnodes), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": compressed_counts, "SLURM_TASKS_PER_NODE": compressed_counts,
        "SLURM_SUBMIT_DIR": "/home/alice", "SLURM_SUBMIT_HOST": "login1", "SLURM_TASK_PID": str(4000 + proc_id),
        "SLURM_TOPOLOGY_ADDR": "node", "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_UMASK": "0022",
        "SLURMD_NODENAME": "node", **extra,
    }


# `srun -N 2 -n 8 --ntasks-per-node=4` on gpu07 and gpu09, task 5 (the second node's second task).
SLURM = srun_task(5, tasks_per_node=[4, 4], step_nodelist="gpu[07,09]", compressed_counts="4(x2)",
                  SLURM_NTASKS_PER_NODE="4")
# What real srun set in `srun -n 2 env` on tests/cluster's one-node SLURM (22.05.8, node 'vm'), task 1.
REAL_SRUN_N2 = {
    "SLURMD_NODENAME": "vm", "SLURM_CLUSTER_NAME": "trainer-test", "SLURM_CONF": "/tmp/trainer-slurm/slurm.conf",
    "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "0,1", "SLURM_JOBID": "1", "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_JOB_GID": "0", "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "bash", "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": "1",
    "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_SRUN_COMM_PORT": "41231", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_LAUNCHER_PORT": "41231", "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": "/tmp",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "2", "SLURM_TASK_PID": "12265", "SLURM_TOPOLOGY_ADDR": "vm",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "trainer-test:127.0.0.1:16817:9728:109",
}
# The shell of `sbatch -n 2` (the batch script, before any srun) and of `salloc -n 2`, captured there too.
REAL_SBATCH_SHELL = {
    **{key: value for key, value in REAL_SRUN_N2.items()
       if not key.startswith(("SLURM_STEP", "SLURM_SRUN", "SLURM_LAUNCH"))},
    "SLURM_JOB_NAME": "capture.sbatch", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_GTIDS": "0",
    "SLURM_NODE_ALIASES": "(null)",
}
REAL_SALLOC_SHELL = {
    "SLURM_CLUSTER_NAME": "trainer-test", "SLURM_JOBID": "3", "SLURM_JOB_CPUS_PER_NODE": "2", "SLURM_JOB_ID": "3",
    "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1",
    "SLURM_JOB_PARTITION": "debug", "SLURM_NNODES": "1", "SLURM_NODELIST": "vm", "SLURM_NODE_ALIASES": "(null)",
    "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
    "SLURM_SUBMIT_DIR": "/tmp", "SLURM_SUBMIT_HOST": "vm", "SLURM_TASKS_PER_NODE": "2",
}


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
    # An salloc shell and an sbatch script before srun: SLURM's variables, even SLURM_PROCID and a task count of
    # 2 in the batch shell, but no step id; the Trainer starts the job's processes itself.
    assert detect_environment(REAL_SALLOC_SHELL).name == "local"
    assert detect_environment(REAL_SBATCH_SHELL).name == "local"
    # `srun -n 1 python train.py`: one task; the Trainer starts the processes itself.
    one_task = srun_task(0, tasks_per_node=[1], step_nodelist="vm", compressed_counts="1")
    assert detect_environment(one_task).name == "local"
    # salloc's interactive step (LaunchParameters=use_interactive_step), SLURM's step id 0xFFFFFFFA.
    interactive_step = {**SLURM, "SLURM_STEP_ID": str(0xFFFFFFFA), "SLURM_STEPID": str(0xFFFFFFFA)}
    assert detect_environment(interactive_step).name == "local"


def test_a_job_named_bash_launched_by_srun_is_a_launch():
    # `srun -n 2 bash -c "python train.py"` names the job bash: it is a launch all the same.
    assert detect_environment(REAL_SRUN_N2).name == "slurm"


def test_real_srun_n2_on_one_node():
    env = detect_environment(REAL_SRUN_N2)
    assert (env.global_rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (1, 1, 2, 2, 0)
    assert (env.master_addr, env.master_port) == ("vm", 15001)


@pytest.mark.parametrize("tasks_per_node, compressed, nodelist, hosts", [
    ([2], "2", "gpu12", ["gpu12"]),  # srun -N 1 -n 2
    ([2, 2], "2(x2)", "node[01-02]", ["node01", "node02"]),  # srun -N 2 -n 4
    ([2, 2, 2, 1], "2(x3),1", "node[01-03,07]", ["node01", "node02", "node03", "node07"]),  # srun -N 4 -n 7
])
def test_every_task_of_an_srun_step_reads_its_coordinates(tasks_per_node, compressed, nodelist, hosts):
    world, ranks_per_node = sum(tasks_per_node), {}
    for rank in range(world):
        task = srun_task(rank, tasks_per_node=tasks_per_node, step_nodelist=nodelist, compressed_counts=compressed)
        env, node = detect_environment(task), int(task["SLURM_NODEID"])
        assert (env.name, env.global_rank, env.world_size, env.node_rank) == ("slurm", rank, world, node)
        assert env.local_world_size == tasks_per_node[node]
        assert env.local_rank == rank - sum(tasks_per_node[:node])
        assert env.master_addr == hosts[0]
        ranks_per_node.setdefault(env.node_rank, []).append(env.local_rank)
    # Every node's processes are local ranks 0..n-1 of a local world of n: devices and threads split right.
    assert [sorted(ranks) for ranks in ranks_per_node.values()] == [list(range(n)) for n in tasks_per_node]


def test_a_step_on_part_of_the_allocation_takes_the_steps_nodes_and_counts():
    # Inside `sbatch -N 4 -n 16`, `srun -N 2 -n 3 --relative=2`: the step runs on node[03-04] with 2,1 tasks,
    # while the job's variables still describe all four nodes.
    env = detect_environment(srun_task(2, tasks_per_node=[2, 1], step_nodelist="node[03-04]", compressed_counts="2,1",
                                       job_nodelist="node[01-04]", step_id=3))
    assert (env.world_size, env.node_rank, env.local_rank, env.local_world_size, env.master_addr) == (
        3, 1, 0, 1, "node03")


def test_master_from_the_job_node_list_when_the_step_list_is_missing():
    # A simulated launch that exported only SLURM_JOB_NODELIST must not rendezvous on each node's loopback.
    task = srun_task(3, tasks_per_node=[2, 2], step_nodelist="cn[5-6]", compressed_counts="2(x2)")
    del task["SLURM_STEP_NODELIST"], task["SLURM_NODELIST"]
    assert detect_environment(task).master_addr == "cn5"
    del task["SLURM_JOB_NODELIST"]
    with pytest.raises(MisconfigurationError, match="SLURM_STEP_NODELIST.*set MASTER_ADDR"):
        detect_environment(task)


def test_local_world_size_without_the_step_counts_and_with_a_bad_count():
    task = srun_task(4, tasks_per_node=[2, 2, 2, 1], step_nodelist="node[01-04]", compressed_counts="2(x3),1")
    del task["SLURM_STEP_TASKS_PER_NODE"]  # an older SLURM: the job's SLURM_TASKS_PER_NODE
    assert detect_environment(task).local_world_size == 2
    with pytest.raises(MisconfigurationError, match=r"SLURM tasks per node '2\(x3\),one'"):
        detect_environment({**task, "SLURM_TASKS_PER_NODE": "2(x3),one"})
    with pytest.raises(MisconfigurationError, match="counts 2 nodes, but SLURM_NODEID is 2"):
        detect_environment({**task, "SLURM_TASKS_PER_NODE": "4(x2)"})


@pytest.mark.parametrize("hostlist, hosts", [
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a,b[001-002]", ["a", "b001", "b002"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[3-1]", "node[a-b]", "node[1-2", "node1]", "a,,b", ""])
def test_unreadable_hostlist_is_a_clear_error(hostlist):
    with pytest.raises(MisconfigurationError, match="cannot read the SLURM host list"):
        expand_hostlist(hostlist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]


def test_open_mpi_variables():
    env = detect_environment(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "node01",
        }
    )
    assert (env.name, env.global_rank, env.world_size, env.local_rank, env.node_rank, env.master_addr) == (
        "mpi", 2, 4, 0, 1, "node01")


def test_mpich_and_intel_mpi_pmi_variables():
    env = detect_environment({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.name, env.global_rank, env.world_size, env.local_rank, env.master_addr) == ("mpi", 1, 2, 1, "127.0.0.1")


def test_mpi_across_nodes_without_master_addr_says_how_to_pass_it():
    with pytest.raises(MisconfigurationError, match="mpirun -x MASTER_ADDR"):
        detect_environment(
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
        )


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


@pytest.mark.parametrize(("omp", "expected"), [(None, 4), ("", 4), ("3", 3), ("4,2", 4), ("0", 1), ("many", 4)])
def test_worker_threads_take_the_users_outer_omp_setting_else_share_the_cores(monkeypatch, omp, expected):
    monkeypatch.setattr("torchyard.trainer.cluster.environment.usable_cores", lambda: 8)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert worker_threads(2) == expected
