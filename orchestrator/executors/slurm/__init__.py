"""The Slurm executor: each attempt one Slurm job (`executor`), through sbatch, squeue, scontrol and scancel
(`jobs`); where attempts go (`target`), a multi-node attempt's shape (`gang`) and its nodes (`nodes`, `nodelaunch`)."""
