from megabert.launch import discover_launch, expand_slurm_nodelist


def test_launchers():
    assert discover_launch({}).launcher == "single"
    t = discover_launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert (t.launcher, t.rank, t.world_size, t.local_rank, t.master_port) == ("torchrun", 3, 8, 1, 29500)
    o = discover_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (o.launcher, o.rank, o.world_size) == ("openmpi", 2, 4)
    m = discover_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"})
    assert (m.launcher, m.rank, m.local_rank) == ("mpich", 1, 1)
    s = discover_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                         "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08],cpu1"})
    assert (s.launcher, s.rank, s.world_size, s.master_addr, s.master_port) == ("slurm", 5, 16, "gpu07", 14242)


def test_nodelist():
    assert expand_slurm_nodelist("n[001-003,010],x") == ["n001", "n002", "n003", "n010", "x"]
