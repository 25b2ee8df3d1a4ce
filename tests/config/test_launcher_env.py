"""megatron.config.launcher_env: SLURM's and OpenMPI's variables mapped onto the launcher's (pure functions over
a dict; the real srun / sbatch runs are in tests/slurm)."""
import pytest

from megatron.config.launcher_env import (describe, expand_hostlist, fill_launcher_env, launcher_env,
                                          tasks_on_node)
from megatron.errors import UserError

# what srun exports to task 5 of `srun -N 2 -n 8 ...` (job 4242, step 0) on node01
SRUN_TASK = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_TASKS_PER_NODE": "4(x2)",
             "SLURM_JOB_NODELIST": "node[00-01]"}


@pytest.mark.parametrize("hostlist,hosts", [
    ("vm", ["vm"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[8-11],cpu5", ["gpu8", "gpu9", "gpu10", "gpu11", "cpu5"]),
    ("a[1,3],b[001-002]", ["a1", "a3", "b001", "b002"]),
    ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
    ("rack1-node[2-3].cluster", ["rack1-node2.cluster", "rack1-node3.cluster"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_bad_hostlist_range_names_it():
    with pytest.raises(UserError, match=r"node\[a-b\].*'a-b'"):
        expand_hostlist("node[a-b]")


@pytest.mark.parametrize("spec,index,count", [("4", 0, 4), ("4(x2),2", 1, 4), ("4(x2),2", 2, 2), ("3,1", 1, 1)])
def test_tasks_on_node(spec, index, count):
    assert tasks_on_node(spec, index) == count


def test_srun_task():
    source, values = launcher_env(SRUN_TASK)
    assert source == "SLURM"
    assert values == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                      "MASTER_ADDR": "node00", "MASTER_PORT": str(10000 + 4242 % 20000)}


def test_ntasks_per_node_and_step_values_win():
    env = dict(SRUN_TASK, SLURM_NTASKS_PER_NODE="2", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NODELIST="node01")
    values = launcher_env(env)[1]
    assert (values["LOCAL_WORLD_SIZE"], values["WORLD_SIZE"], values["MASTER_ADDR"]) == ("2", "4", "node01")


def test_launcher_variables_win_over_slurm():
    """torchrun inside an sbatch script: its RANK/WORLD_SIZE stay, nothing is filled."""
    env = dict(SRUN_TASK, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    before = dict(env)
    assert fill_launcher_env(env, announce=False) == "launcher"
    assert env == before


def test_batch_shell_is_not_a_task():
    """The batch shell of an sbatch script has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step: a plain
    `python pretrain_gpt2.py` there is one process, not rank 0 of SLURM_NTASKS."""
    env = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}
    assert launcher_env(env) == ("none", {})


def test_exported_master_address_and_port_win():
    env = dict(SRUN_TASK, MASTER_ADDR="10.0.0.1", MASTER_PORT="31000")
    assert fill_launcher_env(env, announce=False) == "SLURM"
    assert (env["RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("5", "10.0.0.1", "31000")


def test_openmpi_on_one_node():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert launcher_env(env) == ("OpenMPI", {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2",
                                             "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": "29500"})


def test_openmpi_wins_over_the_batch_shells_slurm_variables():
    """mpirun inside an sbatch script: the ranks are OpenMPI's, the master is the job's first node."""
    env = dict(SRUN_TASK, OMPI_COMM_WORLD_RANK="6", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="2",
               OMPI_COMM_WORLD_LOCAL_SIZE="4")
    source, values = launcher_env(env)
    assert source == "OpenMPI"
    assert (values["RANK"], values["LOCAL_RANK"], values["MASTER_ADDR"]) == ("6", "2", "node00")


def test_openmpi_across_nodes_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(UserError, match=r"8 processes over several nodes \(4 on this one\).*MASTER_ADDR"):
        launcher_env(env)
    env["MASTER_ADDR"] = "host0"
    assert fill_launcher_env(env, announce=False) == "OpenMPI"
    assert env["MASTER_ADDR"] == "host0" and env["RANK"] == "0"


def test_nothing_set_is_a_single_process(capsys):
    env = {}
    assert fill_launcher_env(env) == "none"
    assert env == {}
    assert capsys.readouterr().out == "ranks: from no launcher or scheduler variables: a single process\n"


def test_only_rank_0_announces(capsys):
    fill_launcher_env(dict(SRUN_TASK))
    assert capsys.readouterr().out == ""
    fill_launcher_env(dict(SRUN_TASK, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"))
    assert capsys.readouterr().out == ("ranks: from SLURM's SLURM_PROCID/SLURM_NTASKS (srun): world size 8, 4 per "
                                       "node, rendezvous node00:14242\n")
    assert describe("launcher", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                                 "MASTER_PORT": "1"}).startswith("ranks: from the launcher's RANK/WORLD_SIZE")
